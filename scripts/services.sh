#!/usr/bin/env bash
# Starts the real services the tests use, if they are not running:
# PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379. (The S3 endpoint,
# moto's standalone server, is started by the test fixtures themselves.)
set -uo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if ! port_open 5432; then
  echo "starting PostgreSQL" >&2
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
  else
    echo "PostgreSQL is not running and pg_ctlcluster is missing: install postgresql" >&2
    exit 1
  fi
fi
if ! port_open 6379; then
  echo "starting Redis" >&2
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for i in $(seq 1 30); do
  port_open 5432 && port_open 6379 && exit 0
  sleep 1
done
echo "services did not come up (PostgreSQL :5432, Redis :6379)" >&2
exit 1
