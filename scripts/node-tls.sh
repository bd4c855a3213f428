#!/usr/bin/env bash
# Certificates for the node API over TLS (`sandlot node --tls-cert/--tls-key`, `sandlot
# server --node-ca`; docs/operations.md "TLS on the node API"), made with the openssl CLI.
#
#   scripts/node-tls.sh ca DIR                 a CA: DIR/ca.pem (give it to the servers'
#                                              --node-ca) and DIR/ca.key (keep it private);
#                                              an existing CA is kept
#   scripts/node-tls.sh node DIR NAME SAN...   a certificate for one node signed by DIR's
#                                              CA: DIR/NAME.pem (--tls-cert), DIR/NAME.key
#                                              (--tls-key, PKCS#8); SANs in openssl's form,
#                                              e.g. IP:10.0.0.5 DNS:node1.example — the
#                                              host of the node's --advertise URL must be
#                                              one of them
#
# Keys are EC P-256, certificates valid 825 days. For a real deployment an existing PKI
# (cert-manager, a company CA) does the same; Sandlot only needs PEM files.
set -euo pipefail

die() { echo "node-tls.sh: $*" >&2; exit 1; }
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
command -v openssl >/dev/null || die "openssl not found (Debian: apt-get install openssl)"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; chmod 600 "$1"; }

case "${1:-}" in
  ca)
    [ $# -eq 2 ] || usage
    dir=$2; mkdir -p "$dir"
    if [ -s "$dir/ca.pem" ] && [ -s "$dir/ca.key" ]; then exit 0; fi
    key "$dir/ca.key"
    openssl req -x509 -new -key "$dir/ca.key" -sha256 -days 825 -subj "/CN=sandlot node CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$dir/ca.pem" 2>/dev/null
    ;;
  node)
    [ $# -ge 4 ] || usage
    dir=$2; name=$3; shift 3
    [ -s "$dir/ca.pem" ] && [ -s "$dir/ca.key" ] || die "no CA in $dir (run: $0 ca $dir)"
    [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "node name $name: letters, digits, . _ - only"
    san=$(IFS=,; echo "$*")
    key "$dir/$name.key"
    openssl req -new -key "$dir/$name.key" -subj "/CN=$name" -out "$dir/$name.csr" 2>/dev/null
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
      -sha256 -days 825 -out "$dir/$name.pem" \
      -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$san") 2>/dev/null \
      || die "openssl x509 failed for SANs $san"
    rm -f "$dir/$name.csr"
    ;;
  *) usage ;;
esac
