# Source on the GPU device (no registry there): install the carried wheels in .whl/ whose
# module is missing from the image, and put src/ on the path. `. scripts/device_env.sh`
set -e
mkdir -p /tmp/site
for wheel in .whl/*.whl; do
  [ -e "$wheel" ] || continue
  module=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z' 'a-z')
  if ! python3 -c "import $module" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheel"
  fi
done
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
set +e
