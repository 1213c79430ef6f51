#!/usr/bin/env bash
# One prepared GPU session: the course's GPU path proven on one GPU node in at most 9 minutes, the riskiest
# step first, into one results file (bench/gpu_session.py says what each step proves; --list prints them).
#
# With the device tool (one H200): first, here, `bash bench/carry_wheels.sh` (the packages the node's image
# lacks, as wheels in .whl/, git-ignored); then the call
#     run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
# and commit what comes back (files_at) under bench/results/: <date>T<HHMM>_<device>_gpu-session.json (every
# step: ok/failed/timeout/skipped, seconds, numbers, log tail), ...-logs.txt, ...-files.tar.gz (executed
# notebooks, grading CSVs). Steps that did not fit (skipped, "out of time"): copy that JSON into bench/results/
# (untracked files travel) and call again at once, while the machine is warm (30 s; a fresh start costs minutes of
# the session's 15), with "--resume bench/results/<that>.json --budget S", S what the device time left allows.
# On any CUDA node: `bash bench/gpu_check.sh` writes into bench/results (OUT=DIR elsewhere).
# Without a GPU, the dry run (the same runner and steps at the tiny profile, CUDA-only steps skipped):
#     bash bench/gpu_check.sh --cpu        (or DRY=1 bash bench/gpu_check.sh)
# Other options are bench/gpu_session.py's: --budget S, --jobs N, --only A,B, --skip A,B, --resume OLD.json.
#
# torch and Triton are the node's own (2.11 / 3.6 on the H200 image so far), not the locked 2.13.0 / 3.7.1 of
# requirements/gpu.txt: the CUDA torch wheel and its NVIDIA libraries are GBs, over the device tool's 64 MiB
# per call; the env step records both. Set-up (GPU runs only): carried wheels (.whl/) go into the interpreter's
# own site-packages (where the grader's `python -I` runner and the sandbox, which hides /tmp, find them), and
# where dlo is not installed (the device tool's node) a .pth there puts this checkout's lib/ on every path.
set -u
export DLO_SESSION_T0=${DLO_SESSION_T0:-$(date +%s)}  # the session's budget counts the set-up too
PY=${PY:-python3}
OUT=${OUT:-bench/results}
[ "${DRY:-0}" = 1 ] && set -- --cpu "$@"
case " $* " in *" --cpu "*|*" --list "*|*" -h "*|*" --help "*) dry=1 ;; *) dry=0 ;; esac
if [ "$dry" = 0 ]; then
  command -v nvidia-smi >/dev/null || { echo "gpu_check: no GPU here (nvidia-smi not found): --cpu runs the dry run" >&2
                                        exit 2; }
  setup=${TMPDIR:-/tmp}/dlo-gpu-session-setup.txt
  export DLO_SESSION_SETUP=$setup
  {
    site=$($PY -c 'import site; print(site.getsitepackages()[0])')
    if ls .whl/*.whl >/dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
        && echo "installed $(ls .whl/*.whl | wc -l) carried wheels into $site" \
        || { echo "site-packages not writable: wheels into /opt/dlo-site (PYTHONPATH; the grader's -I runner won't see them)"
             $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /opt/dlo-site .whl/*.whl
             export PYTHONPATH=/opt/dlo-site${PYTHONPATH:+:$PYTHONPATH} JUPYTER_PATH=/opt/dlo-site/share/jupyter; }
    else
      echo "no .whl/ carried: papermill, nbgrader and ipykernel must be there already"
    fi
    if ! "$PY" -I -c "import dlo" 2>/dev/null; then  # not installed (the device tool's node): a .pth, as -e would
      echo "$PWD/lib" > "$site/dlo-checkout.pth" && echo "dlo: $PWD/lib through $site/dlo-checkout.pth" \
        || { echo "no .pth: PYTHONPATH only"; export PYTHONPATH=$PWD/lib${PYTHONPATH:+:$PYTHONPATH}; }
    fi
    chmod -R o+rX lib solutions 2>/dev/null  # read by the sandbox's uid 65534 when grading as root
    echo "set-up took $(( $(date +%s) - DLO_SESSION_T0 )) s"
  } > "$setup" 2>&1
  cat "$setup"
fi
exec "$PY" bench/gpu_session.py --out "$OUT" "$@"
