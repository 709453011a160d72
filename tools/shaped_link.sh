#!/usr/bin/env bash
# Run a command with the loopback link shaped to RATE (a token bucket, `tc qdisc ... tbf`), to
# stand in for a network link between machines, then remove the shaping, also on error or Ctrl-C.
#
#     sudo bash tools/shaped_link.sh 1gbit python tools/interleave.py memory "DDP;fullshard" 6
#
# Loopback has one queue: all ranks' traffic, both directions, shares the one RATE (a shared link,
# not a full-duplex one per rank). Needs CAP_NET_ADMIN; refuses to run over an existing root
# qdisc on lo other than the default, so that it never removes shaping it did not add.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RATE COMMAND... (RATE as tc writes it: 1gbit, 500mbit)" >&2
  exit 2
fi
rate=$1
shift
if tc qdisc show dev lo | grep -qv 'noqueue'; then
  echo "$0: lo already has a qdisc: $(tc qdisc show dev lo); remove it first" >&2
  exit 2
fi
tc qdisc add dev lo root tbf rate "$rate" burst 1mb latency 100ms
trap 'tc qdisc del dev lo root' EXIT
"$@"
