# ---- templates/vpn-hop.sh: WireGuard hop ----------------------------------------------
# The server's private key is read from Secret Manager at boot (never from metadata) and
# written only to /etc/wireguard/wg0.conf (mode 600).
readonly WG_DIR="${SANDBOX_ROOT}/etc/wireguard"
readonly SYSCTL_FILE="${SANDBOX_ROOT}/etc/sysctl.d/60-tpu-pretrain-forwarding.conf"

if ! command -v wg >/dev/null 2>&1; then
  log "installing wireguard-tools"
  apt_install wireguard-tools iptables
fi

if write_if_changed "${SYSCTL_FILE}" 0644 "net.ipv4.ip_forward = 1"; then
  log "IP forwarding configured"
fi
sysctl -q -w net.ipv4.ip_forward=1

private_key="$(retry_gcloud gcloud secrets versions access latest \
  --secret="${WG_SECRET_ID}" --project="${PROJECT}")"
uplink="$(ip -4 route show default | awk '{print $5; exit}')"

umask 077
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
