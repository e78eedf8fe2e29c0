#!/usr/bin/env bash
# Fifth session, batch c: synchronising calls inside a layer step; host cost of single calls.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 120 python3 tools/probe_host.py > $OUT/host.log 2>&1
cat $OUT/host.log | tail -30
