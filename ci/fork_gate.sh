#!/usr/bin/env bash
# The prompt-cache gate on a llama.cpp tree: the one script behind ci/github/prompt-cache-gate.yml,
# and the same steps locally. Usage:
#   ci/fork_gate.sh install                 install the harness (editable, with the test extras)
#   ci/fork_gate.sh build   TREE            build llama-server from TREE (cached by the tree's content)
#   ci/fork_gate.sh server  TREE OUT        gate --backend server --source TREE  -> OUT/gate-server.{json,xml}
#                                           (--base SERVER_BASE when set: a tree or a revision of TREE's git
#                                           checkout, e.g. a pull request's base: differences are the change's)
#   ci/fork_gate.sh default TREE OUT        the default gate (model + libllama) on TREE's own libllama
#                                           (gate --source TREE)                  -> OUT/gate.{json,xml}
#   ci/fork_gate.sh memory  TREE OUT        the memory figures of the server gate -> OUT/memory.{json,md}
#   ci/fork_gate.sh all     TREE OUT        build, server, default, memory; exits with the worst exit code
# Extra gate flags: SERVER_GATE_ARGS (e.g. "--semantics master"), GATE_ARGS (e.g. "--seed 3").
# Exit codes are the gate's: 0 pass, 1 a property failed, 2 usage/environment, 3 crash, 4 build failed;
# a step the harness cannot run on this tree (its exit 6: e.g. its llama.h lacks a function the harness calls) is
# a skip, said in OUT/skipped.txt and the log, and exits 0 here: a fork's CI is red only for its change.
set -uo pipefail
HARNESS="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python}"
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}"

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
need_tree() { [ -n "${1:-}" ] && [ -d "$1" ] || { echo "fork_gate: not a directory: ${1:-<missing TREE>}" >&2; exit 2; }; }
need_out() { [ -n "${1:-}" ] || { echo "fork_gate: missing OUT directory" >&2; exit 2; }; mkdir -p "$1"; }
abs() { (cd "$1" && pwd); }
# the gate's exit 6 (a limit of the harness on this tree) is a skip: said, and 0; any other code as it is
skip_or() {
  local rc=$1 step=$2 log=$3 out=$4
  if [ "$rc" -eq 6 ]; then
    echo "fork_gate: $step skipped on this tree (a limit of the harness, not the change): $(grep -m1 '^SKIPPED' "$log" \
      || tail -n1 "$log")" | tee -a "$out/skipped.txt"
    return 0
  fi
  return "$rc"
}

step="${1:-}"; shift || true
case "$step" in
  install)
    "$PY" -m pip install -q -e "$HARNESS[test]" || exit 1
    # ccache makes a branch's base (and every rebuild) recompile only what differs; optional
    command -v ccache >/dev/null || { command -v apt-get >/dev/null && { sudo -n apt-get install -y -qq ccache \
      || apt-get install -y -qq ccache; } >/dev/null 2>&1; } || echo "fork_gate: no ccache (builds are slower)" >&2
    ;;
  build)
    need_tree "${1:-}"
    (cd "$HARNESS" && "$PY" -m harness build-server --source "$(abs "$1")")
    ;;
  server)
    need_tree "${1:-}"; need_out "${2:-}"
    tree="$(abs "$1")"; out="$(abs "$2")"
    base=()
    [ -n "${SERVER_BASE:-}" ] && base=(--base "$SERVER_BASE")
    # shellcheck disable=SC2086  # SERVER_GATE_ARGS is a list of flags
    (cd "$HARNESS" && "$PY" -m harness gate --backend server --source "$tree" "${base[@]}" ${SERVER_GATE_ARGS:-} \
      --json "$out/gate-server.json" --junit "$out/gate-server.xml") 2>&1 | tee "$out/gate-server.log"
    skip_or "${PIPESTATUS[0]}" server "$out/gate-server.log" "$out"
    ;;
  default)
    need_tree "${1:-}"; need_out "${2:-}"
    tree="$(abs "$1")"; out="$(abs "$2")"
    # shellcheck disable=SC2086  # GATE_ARGS is a list of flags
    (cd "$HARNESS" && "$PY" -m harness gate --source "$tree" ${GATE_ARGS:-} --json "$out/gate.json" \
      --junit "$out/gate.xml") 2>&1 | tee "$out/gate.log"
    skip_or "${PIPESTATUS[0]}" default "$out/gate.log" "$out"
    ;;
  memory)
    need_out "${2:-}"
    out="$(abs "$2")"
    (cd "$HARNESS" && "$PY" -m ci.memory_summary "$out/gate-server.json" "$out"); rc=$?
    if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then  # the job's summary: the figures, and what was skipped and why
      [ -f "$out/memory.md" ] && cat "$out/memory.md" >> "$GITHUB_STEP_SUMMARY"
      [ -f "$out/skipped.txt" ] && { printf '\n## Skipped steps\n\n'; sed 's/^/- /' "$out/skipped.txt"; } \
        >> "$GITHUB_STEP_SUMMARY"
    fi
    exit "$rc"
    ;;
  all)
    need_tree "${1:-}"; need_out "${2:-}"
    worst=0
    "$0" build "$1" || exit $?
    for s in server default memory; do
      "$0" "$s" "$1" "$2"; rc=$?
      [ "$rc" -gt "$worst" ] && worst=$rc
    done
    echo "fork_gate: done, exit $worst (reports in $2)"
    exit "$worst"
    ;;
  *) usage ;;
esac
