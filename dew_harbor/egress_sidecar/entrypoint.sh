#!/bin/sh
# Harbor's sidecar entrypoint (harbor 0.25, harbor-docker-egress-control-sidecar/entrypoint.sh) without gost: apply the
# initial policy, mark the sidecar ready for the compose healthcheck, then wait.
set -eu
ALLOWLIST=/opt/egress-sidecar/allowlist.txt
NFTABLES_RULESET_NAME=gost_egress
READY_FILE=/tmp/harbor-docker-egress-control-sidecar.ready
INITIAL_NETWORK_MODE="${EGRESS_CONTROL_INITIAL_NETWORK_MODE:-public}"
INITIAL_ALLOWED_HOSTS="${EGRESS_CONTROL_INITIAL_ALLOWED_HOSTS:-}"

cleanup() {
  rm -f "$READY_FILE"
  nft delete table inet "$NFTABLES_RULESET_NAME" 2>/dev/null || true
}

mkdir -p "$(dirname "$ALLOWLIST")"
: > "$ALLOWLIST"
cleanup
trap 'cleanup; exit 0' INT TERM

case "$INITIAL_NETWORK_MODE" in
  public) network-policy allow-all ;;
  no-network) network-policy deny-all ;;
  allowlist)
    set -f
    # shellcheck disable=SC2086
    network-policy allow $INITIAL_ALLOWED_HOSTS
    set +f
    ;;
  *) echo "invalid EGRESS_CONTROL_INITIAL_NETWORK_MODE: $INITIAL_NETWORK_MODE" >&2; exit 2 ;;
esac

touch "$READY_FILE"
echo "harbor-docker-egress-control-sidecar (dew-ray stand-in) ready: initial egress policy is $INITIAL_NETWORK_MODE"
while :; do sleep 3600 & wait $!; done
