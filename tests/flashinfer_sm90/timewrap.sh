#!/bin/bash
# nvcc/c++ launcher for the build: runs the compiler under /usr/bin/time -v, the record written to <output>.time
# (the link step takes only objects whose record says "Exit status: 0")
out=""; prev=""
for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done
exec /usr/bin/time -v -o "${out:-/tmp/unknown}.time" "$@"
