# Sourced by _env.sh and _env312.sh. `use_venv VENV PYTHON CONSTRAINTS EXTRAS WHAT` creates VENV
# with PYTHON if it is missing, installs the project with EXTRAS under CONSTRAINTS once (a stamp
# of pyproject.toml and the constraints file says whether it is current), and puts VENV first on
# PATH. WHAT is the line printed before an install.
# `venv_installed VENV`: whether an install into VENV ever finished (any stamp, current or not:
# updating such a venv installs only what changed).
venv_installed() {
  ls "$1"/.installed-* > /dev/null 2>&1
}

use_venv() {
  local venv="$1" py="$2" constraints="$3" extras="$4" what="$5" stamp
  stamp="$venv/.installed-$(cat "$ROOT/pyproject.toml" "$constraints" | sha256sum | cut -c1-16)"
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
  fi
  if [ ! -f "$stamp" ]; then
    echo "$what"
    if ! "$venv/bin/python" -m pip install -c "$constraints" -e "$ROOT[$extras]" \
        > "$venv/install.log" 2>&1; then
      grep -v "WARNING: Location" "$venv/install.log" | tail -n 40
      echo "install failed; full log: $venv/install.log" >&2
      exit 1
    fi
    rm -f "$venv"/.installed-*
    touch "$stamp"
  fi
  export PATH="$venv/bin:$PATH"
}
