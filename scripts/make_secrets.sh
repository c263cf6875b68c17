#!/usr/bin/env bash
# Writes the secrets docker-compose.yml mounts (under secrets/, git-ignored):
#   postgres_password      the database password (PostgreSQL and the farm read it)
#   farm_admin_token       the API's bootstrap admin token (the API alone)
#   s3_identities.json     the S3 server's identities: an admin and the farm's
#                          application keys, which may only read, write and
#                          list the farm's bucket
#   s3_admin_credentials   the admin keys, for the bucket-creating step only
#   s3_farm_credentials    the application keys, for the API and the workers
# A file that exists is kept: to rotate one, move it away and run this again
# (docs/operations.md, "Rotating keys"). The signing keys are made with
# `farm keys` (docs/security.md), not here.
# Ownership: the farm's containers run as uid 10001 and PostgreSQL's as 999,
# and a compose secret is the host file itself, mounted with its owner and
# mode; run as root (sudo) so the files get those owners, mode 0600 or 0640.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${FARM_SECRETS_DIR:-secrets}
bucket=${FARM_BUCKET:-torch-farm}
FARM_UID=10001
PG_GID=999
umask 077
mkdir -p "$dir"
rand() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }
made=()
write() {  # write NAME CONTENT, unless it exists
  if [ -e "$dir/$1" ]; then return; fi
  printf '%s\n' "$2" > "$dir/$1"
  made+=("$1")
}
write postgres_password "$(rand 24)"
write farm_admin_token "$(rand 24)"
if [ ! -e "$dir/s3_identities.json" ]; then
  admin_key=admin-$(rand 6); admin_secret=$(rand 24)
  farm_key=farm-$(rand 6); farm_secret=$(rand 24)
  write s3_identities.json "$(cat <<JSON
{
  "identities": [
    {"name": "admin",
     "credentials": [{"accessKey": "$admin_key", "secretKey": "$admin_secret"}],
     "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
    {"name": "farm",
     "credentials": [{"accessKey": "$farm_key", "secretKey": "$farm_secret"}],
     "actions": ["Read:$bucket", "Write:$bucket", "List:$bucket"]}
  ]
}
JSON
)"
  rm -f "$dir/s3_admin_credentials" "$dir/s3_farm_credentials"
  write s3_admin_credentials "$(printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s' \
    "$admin_key" "$admin_secret")"
  write s3_farm_credentials "$(printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s' \
    "$farm_key" "$farm_secret")"
fi
if [ "$(id -u)" = 0 ]; then
  for f in farm_admin_token s3_admin_credentials s3_farm_credentials; do
    chown "$FARM_UID:$FARM_UID" "$dir/$f"; chmod 0600 "$dir/$f"
  done
  for f in farm_name_key.pem farm_builder_key.pem farm_root_key.pem.pub; do
    if [ -e "$dir/$f" ]; then chown "$FARM_UID:$FARM_UID" "$dir/$f"; fi
  done
  # Both the farm (owner) and PostgreSQL (group) read the password.
  chown "$FARM_UID:$PG_GID" "$dir/postgres_password"; chmod 0640 "$dir/postgres_password"
  # SeaweedFS runs as root in its container.
  chmod 0600 "$dir/s3_identities.json"
else
  echo "make_secrets: not root: the containers cannot read files only you can read;" \
       "run it with sudo, or chown them as this script does when root" >&2
fi
if [ "${#made[@]}" -gt 0 ]; then
  echo "made: ${made[*]} (in $dir)"
else
  echo "every secret exists already (in $dir)"
fi
