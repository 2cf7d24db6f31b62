#!/usr/bin/env bash
# Reader and planning fuzzer smoke (docs/fuzzing.md, "Model readers and
# planning"): marconi-ffi's fuzz_readers example over 8 seeds of 3000 calls
# (mutated GGUF files and Hugging Face configs of every family, paths that
# are not regular files, marconi_plan with extreme arguments), every call
# under a 5 s watchdog, stopped after 30 s whatever the seeds reached. Fails
# on any finding (exit 1) or hang (exit 3). Runs from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The test run's own fuzz_readers (ci/built.sh): its build is reused.
"$(bash ci/built.sh example fuzz_readers)" --seed 0 --seeds 8 --calls 3000 --seconds 30 --call-timeout 5
