# ---- templates/vpn-hop.sh: WireGuard hop ----------------------------------------------
# The hop makes its own key pair at its first boot and keeps the private key on its own disk
# (WG_KEY_FILE and wg0.conf, both mode 600): it is in no metadata, no secret, no API and no
# Pulumi state. Only the public key leaves the VM, as the guest attribute
# WG_PUBLIC_KEY_ATTRIBUTE (Compute Engine's "Setting and querying guest attributes": written
# from inside the VM only, read from outside with compute.instances.getGuestAttributes),
# which `make vpn-config` puts into the client's configuration.
readonly WG_DIR="${SANDBOX_ROOT}/etc/wireguard"
readonly WG_KEY_FILE="${WG_DIR}/tpu-pretrain-server.key"
readonly SYSCTL_FILE="${SANDBOX_ROOT}/etc/sysctl.d/60-tpu-pretrain-forwarding.conf"
readonly GUEST_ATTRIBUTES="http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes"

if ! command -v wg >/dev/null 2>&1; then
  log "installing wireguard-tools"
  apt_install wireguard-tools iptables
fi

if write_if_changed "${SYSCTL_FILE}" 0644 "net.ipv4.ip_forward = 1"; then
  log "IP forwarding configured"
fi
sysctl -q -w net.ipv4.ip_forward=1

umask 077
mkdir -p "${WG_DIR}"
# A key file that `wg pubkey` cannot read (none yet, or cut short by a crash) is made anew:
# written to a temporary file in the same directory, then renamed, so it is whole or absent.
if ! { [ -s "${WG_KEY_FILE}" ] && wg pubkey <"${WG_KEY_FILE}" >/dev/null 2>&1; }; then
  key_tmp="$(mktemp "${WG_DIR}/.server-key.XXXXXX")"
  wg genkey >"${key_tmp}"
  chmod 0600 "${key_tmp}"
  mv -f "${key_tmp}" "${WG_KEY_FILE}"
  log "made the hop's WireGuard key pair (the private key stays in ${WG_KEY_FILE#"${SANDBOX_ROOT}"})"
fi
public_key="$(wg pubkey <"${WG_KEY_FILE}")"
private_key="$(cat "${WG_KEY_FILE}")"
uplink="$(ip -4 route show default | awk '{print $5; exit}')"

if write_if_changed "${WG_DIR}/wg0.conf" 0600 "[Interface]
Address = ${WG_SERVER_ADDRESS}
ListenPort = ${WG_PORT}
MTU = ${WG_MTU}
PrivateKey = ${private_key}
PostUp = iptables -t nat -A POSTROUTING -s ${VPN_CLIENT_CIDR} -o ${uplink} -j MASQUERADE; iptables -A FORWARD -i %i -j ACCEPT; iptables -A FORWARD -o %i -m state --state RELATED,ESTABLISHED -j ACCEPT
PostDown = iptables -t nat -D POSTROUTING -s ${VPN_CLIENT_CIDR} -o ${uplink} -j MASQUERADE; iptables -D FORWARD -i %i -j ACCEPT; iptables -D FORWARD -o %i -m state --state RELATED,ESTABLISHED -j ACCEPT

[Peer]
PublicKey = ${WG_CLIENT_PUBLIC_KEY}
AllowedIPs = ${WG_CLIENT_ADDRESS}"; then
  UNITS_CHANGED=1
  log "wg0.conf written"
fi
unset private_key

systemctl enable --quiet wg-quick@wg0
if [ "${UNITS_CHANGED}" = 1 ]; then
  systemctl restart wg-quick@wg0
else
  systemctl start wg-quick@wg0
fi
log "WireGuard listening on UDP ${WG_PORT}"

# Published at every boot, once the tunnel listens: a client that reads the key can connect.
# The metadata server answers a VM's own writes; a failure leaves the tunnel up and says how
# else to read the key.
published=0
for ((attempt = 1; attempt <= RETRY_ATTEMPTS; attempt++)); do
  if curl -fsS -X PUT --data "${public_key}" -H 'Metadata-Flavor: Google' \
    "${GUEST_ATTRIBUTES}/${WG_PUBLIC_KEY_ATTRIBUTE}" >/dev/null 2>&1; then
    published=1
    break
  fi
  sleep 5
done
if [ "${published}" = 1 ]; then
  log "public key ${public_key} published as the guest attribute ${WG_PUBLIC_KEY_ATTRIBUTE}"
else
  log "could not publish the public key ${public_key} as the guest attribute ${WG_PUBLIC_KEY_ATTRIBUTE}; on the hop: sudo wg show wg0 public-key"
fi
