#!/usr/bin/env bash
# TLS material for a Flower deployment: a self-signed CA and a SuperLink server certificate.
#
#   scripts/make_certs.sh [OUT_DIR] [SUPERLINK_HOST ...]
#
# OUT_DIR (default: certificates) receives ca.crt, ca.key, server.pem, server.key. Every
# SUPERLINK_HOST (DNS name or IP address the SuperNodes and the flwr CLI dial) goes into the
# certificate's subjectAltName, next to localhost, 127.0.0.1 and ::1. CERT_DAYS sets the
# validity (default 365). Start the SuperLink with
#   --ssl-ca-certfile OUT_DIR/ca.crt --ssl-certfile OUT_DIR/server.pem --ssl-keyfile OUT_DIR/server.key
# and give ca.crt (never ca.key) to SuperNodes (--root-certificates) and to the flwr CLI
# (root-certificates in $FLWR_HOME/config.toml). See docs/deployment.md.
set -euo pipefail

out=${1:-certificates}
[[ $# -gt 0 ]] && shift
days=${CERT_DAYS:-365}
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }

sans="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
  if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then sans+=",IP:$host"; else sans+=",DNS:$host"; fi
done

mkdir -p "$out"
umask 077
openssl genrsa -out "$out/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha256 -days "$days" -subj "/CN=fedbasin federation CA" \
  -out "$out/ca.crt"
openssl genrsa -out "$out/server.key" 4096 2>/dev/null
openssl req -new -key "$out/server.key" -subj "/CN=${1:-localhost}" -out "$out/server.csr"
cat > "$out/server.ext" <<EXT
subjectAltName=$sans
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
EXT
openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
  -days "$days" -sha256 -extfile "$out/server.ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/server.ext" "$out/ca.srl"
chmod 644 "$out/ca.crt" "$out/server.pem"
echo "wrote $out/{ca.crt,ca.key,server.pem,server.key} for $sans"
