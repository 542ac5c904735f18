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
#
# An existing CA (ca.key or ca.crt in OUT_DIR) is never overwritten: the script refuses and
# exits 1, since certificates already issued by that CA would stop verifying. Files are made in a
# temporary directory and moved into OUT_DIR only once all exist.
set -euo pipefail

out=${1:-certificates}
[[ $# -gt 0 ]] && shift
days=${CERT_DAYS:-365}
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }

sans="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
  if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then sans+=",IP:$host"; else sans+=",DNS:$host"; fi
done

for file in ca.key ca.crt; do
  if [[ -e $out/$file ]]; then
    echo "make_certs.sh: $out/$file exists; refusing to overwrite an existing CA (use another OUT_DIR)" >&2
    exit 1
  fi
done
mkdir -p "$out"
umask 077
tmp=$(mktemp -d "$out/.make_certs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
openssl genrsa -out "$tmp/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$tmp/ca.key" -sha256 -days "$days" -subj "/CN=fedbasin federation CA" \
  -out "$tmp/ca.crt"
openssl genrsa -out "$tmp/server.key" 4096 2>/dev/null
openssl req -new -key "$tmp/server.key" -subj "/CN=${1:-localhost}" -out "$tmp/server.csr"
cat > "$tmp/server.ext" <<EXT
subjectAltName=$sans
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
EXT
openssl x509 -req -in "$tmp/server.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial \
  -days "$days" -sha256 -extfile "$tmp/server.ext" -out "$tmp/server.pem" 2>/dev/null
chmod 644 "$tmp/ca.crt" "$tmp/server.pem"
for file in server.key server.pem ca.crt ca.key; do  # the CA last: a rerun after a failure starts over
  mv "$tmp/$file" "$out/$file"
done
echo "wrote $out/{ca.crt,ca.key,server.pem,server.key} for $sans"
