# The Dataflow workers' image (docs/encoding-at-scale.md, "How workers get tokenizers";
# docs/deploy-gcp.md, "Dataflow"): Beam's Python SDK image of the version requirements/beam.txt
# pins, that file, and the payload without its dependencies (the file has them). Built from
# the payload archive the stack uploads, which holds this file, requirements/beam.txt and
# the payload, so the image's tag (the archive's digest) names its source.
FROM apache/beam_python3.11_sdk:2.77.0
COPY requirements/beam.txt /tmp/beam.txt
RUN pip install --no-cache-dir -r /tmp/beam.txt
COPY . /opt/payload
RUN pip install --no-cache-dir --no-deps /opt/payload
