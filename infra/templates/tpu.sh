# ---- templates/tpu.sh: the TPU VM trainer ---------------------------------------------
# TensorFlow for TPU: tensorflow-tpu from PyPI (same version as the tested tensorflow in
# the lock) with a pinned libtpu; tf_keras goes in with --no-deps because it requires the
# `tensorflow` distribution, which tensorflow-tpu replaces.
install_requirements() {
  local venv="$1" src="$2" work="$3"
  grep -Ev '^(tensorflow|tf[-_]keras)==' "${src}/requirements/payload.lock" >"${work}/lock-tpu.txt"
  "${venv}/bin/pip" install --quiet -r "${work}/lock-tpu.txt" \
    "tensorflow-tpu==${TF_TPU_VERSION}" "libtpu==${LIBTPU_VERSION}"
  "${venv}/bin/pip" install --quiet --no-deps "tf_keras==${TF_KERAS_VERSION}"
}

trap 'write_status failed "startup script failed at line ${LINENO}"' ERR
write_status starting "startup script started"
install_payload

# The trainer waits for the controller's data manifest, then trains; on failure systemd
# restarts it and it resumes from the last checkpoint in the bucket. gcloud is called by
# absolute path: systemd's PATH need not contain the image's SDK location.
gcloud_bin="$(command -v gcloud)"
install_unit tpu-pretrain-train.service "[Unit]
Description=tpu-pretrain trainer for job ${JOB_NAME}
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=oneshot
RemainAfterExit=yes
Environment=TF_USE_LEGACY_KERAS=1
Environment=PYTHONUNBUFFERED=1
ExecStartPre=/bin/sh -c 'until ${gcloud_bin} storage ls ${MANIFEST_URI} >/dev/null 2>&1; do echo waiting for ${MANIFEST_URI}; sleep 60; done'
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload train --job ${JOB_URI}
Restart=on-failure
RestartSec=60
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target"

start_units tpu-pretrain-train.service
write_status started "trainer unit started; waits for ${MANIFEST_URI}"
