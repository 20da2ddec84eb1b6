# ---- templates/controller.sh: data preparation and TensorBoard on CPU -----------------
# The controller runs the tested CPU environment: the lock file as is.
install_requirements() {
  local venv="$1" src="$2"
  "${venv}/bin/pip" install --quiet -r "${src}/requirements/payload.lock"
}

trap 'write_status failed "startup script failed at line ${LINENO}"' ERR
write_status starting "startup script started"
install_payload

# Tokenizer, then encoding; each stage skips work that is already complete in the bucket.
install_unit tpu-pretrain-data.service "[Unit]
Description=tpu-pretrain data preparation for job ${JOB_NAME}
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=oneshot
RemainAfterExit=yes
Environment=PYTHONUNBUFFERED=1
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload tokenizer --job ${JOB_URI}
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload encode --job ${JOB_URI}
Restart=on-failure
RestartSec=60
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target"

install_unit tpu-pretrain-tensorboard.service "[Unit]
Description=TensorBoard for job ${JOB_NAME} (reach it over the VPN)
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/opt/tpu-pretrain/venv/bin/tensorboard --logdir ${RUN_ROOT}/logs --host 0.0.0.0 --port ${TENSORBOARD_PORT}
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target"

start_units tpu-pretrain-data.service tpu-pretrain-tensorboard.service
write_status started "data preparation and TensorBoard units started"
