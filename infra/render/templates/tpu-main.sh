# ---- templates/tpu-main.sh: the TPU VM's startup, after tpu.sh's functions -----------
# With set -E the trap fires in every enclosing function: report the innermost line once.
trap '[ -n "${FAILED_AT:-}" ] || { FAILED_AT="${LINENO}"; write_status failed "startup script failed at line ${LINENO}"; }' ERR
log "step 1/4: checks (runtime ${RUNTIME_VERSION}, accelerator ${ACCELERATOR_TYPE})"
gcs_cli
if [ "${TPU_HOSTS}" -gt 1 ]; then
  read_slice
  write_status starting "startup script started on worker ${WORKER} of the ${ACCELERATOR_TYPE} slice, workers ${SLICE_IPS} (${RUNTIME_VERSION})${SLICE_NOTE}"
else
  write_status starting "startup script started on ${ACCELERATOR_TYPE} (${RUNTIME_VERSION})"
fi
check_python
log "step 2/4: payload install"
install_started="${SECONDS}"
install_payload
if [ "${TPU_HOSTS}" -gt 1 ]; then
  record_facts "$((SECONDS - install_started))" "worker=${WORKER}" "slice_hosts=${TPU_HOSTS}"
else
  record_facts "$((SECONDS - install_started))"
fi
log "step 3/4: trainer unit"
install_helper

if [ "${TPU_HOSTS}" -gt 1 ]; then
  slice_units
  exit 0
fi

# A single host's trainer (install_trainer_unit). Its environment is what TensorFlow needs
# to find the TPU through PJRT, as Google's TF TPU CI sets it for a single host
# (GoogleCloudPlatform/ml-auto-solutions dags/solutions_team/configs/tensorflow/common.py,
# export_env_variables: TF_USE_LEGACY_KERAS, WRAPT_DISABLE_EXTENSIONS, TPU_NAME=local,
# NEXT_PLUGGABLE_DEVICE_USE_C_API, TF_PLUGGABLE_DEVICE_LIBRARY_PATH = libtpu.so; its
# TF_XLA_FLAGS are for its sparse-core models and left out), plus FORCE_TF_AVAILABLE=1:
# transformers 4.57 does not count the `tensorflow-tpu` distribution as TensorFlow (the
# payload sets it too when tensorflow-tpu is installed, so a CLI run by hand over SSH sees
# TensorFlow without this unit's environment: payload/__init__.py).
# systemd units read no login profile: everything is set here.
# Keras 3 on JAX (PAYLOAD_BACKEND=jax; a slice's hosts use the same, plus slice_units' two):
# jax[tpu] finds libtpu itself (Google's and JAX's install docs set nothing but
# `pip install "jax[tpu]"`); JAX_PLATFORMS=tpu turns a TPU that does not initialise into an
# error instead of a run on the host CPU: with JAX_PLATFORMS set, a backend that fails to
# initialise raises "Unable to initialize backend 'tpu'" (jax-ml/jax jax-v0.10.2 = 990e6a0b,
# jax/_src/xla_bridge.py backends(): fail_quietly is False for every listed platform).
if [ "${PAYLOAD_BACKEND}" = jax ]; then
  install_trainer_unit "" "" "Environment=JAX_PLATFORMS=tpu" ""
else
  libtpu_path="/opt/tpu-pretrain/venv/$(tpu_libtpu_path "${APP_DIR}/venv")"
  install_trainer_unit "" "" "Environment=NEXT_PLUGGABLE_DEVICE_USE_C_API=true
Environment=TF_PLUGGABLE_DEVICE_LIBRARY_PATH=${libtpu_path}
Environment=TPU_NAME=local" ""
fi

log "step 4/4: start"
start_units tpu-pretrain-train.service
write_status started "trainer unit started; waits for ${MANIFEST_URI}"
