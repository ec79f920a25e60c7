#!/bin/sh
# unsloth installer for Linux, WSL and macOS (CPU-only there).
#
#   curl -fsSL <release>/install.sh | sh              the released package (UNSLOTH_VERSION picks one)
#   sh install.sh [--yes] [--dry-run] [--help]         from a clone: installs that clone
#
# This script only finds a Python, gets uv, and creates a small bootstrap environment holding this
# package; `unsloth install` then makes every hardware decision and builds the managed environment
# transactionally. Options are flags or UNSLOTH_* variables (docs/install.md); a piped run takes
# the variables, e.g. `curl -fsSL <url>/install.sh | UNSLOTH_YES=1 sh`.
#
# Everything is inside functions and `main "$@"` is the last line: a partial download runs nothing.

set -eu

UV_VERSION=0.13.9   # the standalone uv fetched when neither uv nor a usable Python with pip is found (uv_wheel)
UV_MIN=0.8
PYTHON_MIN=3.10
PYTHON_MAX=3.13
PYTHON_DEFAULT=3.12 # what uv installs when the system has no usable Python
RELEASES=${UNSLOTH_RELEASE_URL:-https://github.com/unsloth-installer/unsloth/releases}

# Progress, warnings and errors go to stderr, as installers do: stdout is `unsloth install`'s own.
say() { printf '%s\n' "==> $*" >&2; }
warn() { printf '%s\n' "warning: $*" >&2; }
die() {
  printf '%s\n' "error: $*" >&2
  exit 1
}

usage() {
  cat <<'EOF'
Install unsloth: a managed environment matched to this machine's GPU, and the `unsloth` command.

Usage: sh install.sh [options] [-- options for `unsloth install`]
       curl -fsSL <release>/install.sh | [UNSLOTH_...=value] sh

  -y, --yes               do not ask (also UNSLOTH_YES=1; implied without a terminal)
  -n, --dry-run           show what would happen and the plan; change nothing
      --version V         install release V instead of the latest (UNSLOTH_VERSION)
      --source PATH|URL   install this source tree or archive (UNSLOTH_SOURCE)
      --home DIR          install home (UNSLOTH_HOME; default ~/.local/share/unsloth)
      --bin-dir DIR       where the `unsloth` launcher goes (UNSLOTH_BIN_DIR; default ~/.local/bin)
      --python PY         use this Python (UNSLOTH_PYTHON)
      --index-url URL     package index / mirror for everything but PyTorch (UNSLOTH_INDEX_URL)
      --extra-index-url U another index (UNSLOTH_EXTRA_INDEX_URL)
      --find-links DIR    a wheelhouse, for offline installs (UNSLOTH_FIND_LINKS)
      --torch-index-url U take PyTorch from this index, e.g. a mirror (UNSLOTH_TORCH_INDEX_URL)
      --without PART      leave out llama-cpp, export, bitsandbytes, fla or train (UNSLOTH_WITHOUT)
      --with PART         add vllm: GRPO rollouts for fast_inference=True, on Linux/WSL with an NVIDIA GPU;
                          it pins the torch its wheel was built for (UNSLOTH_WITH)
      --pip               install with pip instead of uv (UNSLOTH_INSTALLER=pip)
      --no-modify-path    do not add the launcher's folder to PATH (UNSLOTH_NO_MODIFY_PATH=1)
  -h, --help              this help

Your pip configuration (indexes, find-links, constraints) is honoured. Nothing here uses sudo:
anything that needs root is printed for you to run. See docs/install.md.
EOF
}

# Flags become the UNSLOTH_* variables that `unsloth install` reads too: one set of names.
parse_args() {
  DRY_RUN=0
  while [ $# -gt 0 ]; do
    case $1 in
      -y | --yes) UNSLOTH_YES=1 ;;
      -n | --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      --pip) UNSLOTH_INSTALLER=pip ;;
      --no-modify-path) UNSLOTH_NO_MODIFY_PATH=1 ;;
      --version | --source | --home | --bin-dir | --python | --index-url | --extra-index-url | --find-links | --torch-index-url | --without | --with)
        [ $# -ge 2 ] || die "$1 needs a value (see --help)"
        set_option "$1" "$2"
        shift
        ;;
      --) shift; break ;;
      *) die "unknown option: $1 (see --help)" ;;
    esac
    shift
  done
  PASSTHROUGH_COUNT=$#
  export UNSLOTH_YES UNSLOTH_INSTALLER UNSLOTH_NO_MODIFY_PATH
}

set_option() {
  case $1 in
    --version) UNSLOTH_VERSION=$2 ;;
    --source) UNSLOTH_SOURCE=$2 ;;
    --home) UNSLOTH_HOME=$2 ;;
    --bin-dir) UNSLOTH_BIN_DIR=$2; export UNSLOTH_BIN_DIR ;;
    --python) UNSLOTH_PYTHON=$2; export UNSLOTH_PYTHON ;;
    --index-url) UNSLOTH_INDEX_URL=$2; export UNSLOTH_INDEX_URL ;;
    --extra-index-url) UNSLOTH_EXTRA_INDEX_URL="${UNSLOTH_EXTRA_INDEX_URL:-} $2"; export UNSLOTH_EXTRA_INDEX_URL ;;
    --find-links) UNSLOTH_FIND_LINKS="${UNSLOTH_FIND_LINKS:-} $2"; export UNSLOTH_FIND_LINKS ;;
    --torch-index-url) UNSLOTH_TORCH_INDEX_URL=$2; export UNSLOTH_TORCH_INDEX_URL ;;
    --without) UNSLOTH_WITHOUT="${UNSLOTH_WITHOUT:-} $2"; export UNSLOTH_WITHOUT ;;
    --with) UNSLOTH_WITH="${UNSLOTH_WITH:-} $2"; export UNSLOTH_WITH ;;
  esac
}

detect_os() {
  case $(uname -s) in
    Linux)
      OS=linux
      if grep -qi microsoft /proc/version 2>/dev/null; then OS=wsl; fi
      ;;
    Darwin)
      OS=macos
      say "macOS: PyTorch has no CUDA or ROCm here, so this installs a CPU (Apple MPS) environment."
      ;;
    *) die "$(uname -s) is not supported by install.sh; on Windows use install.ps1 (see docs/install.md)" ;;
  esac
  ARCH=$(uname -m)
}

default_home() {
  if [ "$OS" = macos ]; then
    printf '%s' "$HOME/Library/Application Support/unsloth"
  else
    printf '%s' "${XDG_DATA_HOME:-$HOME/.local/share}/unsloth"
  fi
}

have() { command -v "$1" >/dev/null 2>&1; }

# The command that installs packages here, for messages (we never run it ourselves).
root_install_hint() {
  if have apt-get; then echo "sudo apt-get install -y $*"
  elif have dnf; then echo "sudo dnf install -y $*"
  elif have pacman; then echo "sudo pacman -S --needed $*"
  elif have zypper; then echo "sudo zypper install -y $*"
  elif have apk; then echo "sudo apk add $*"
  elif have brew; then echo "brew install $*"
  else echo "install with your package manager: $*"
  fi
}

# All missing tools at once, each with the command that provides it.
check_tools() {
  missing=""
  for tool in uname mkdir rm grep awk; do
    have "$tool" || missing="$missing $tool"
  done
  if [ "${NEED_DOWNLOAD:-0}" = 1 ]; then
    have curl || have wget || missing="$missing curl"
    have unzip || have python3 || can_unzip_with_tar || missing="$missing unzip"
    have sha256sum || have shasum || missing="$missing coreutils"
  fi
  if [ -n "$missing" ]; then
    die "missing tools:$missing. Install them, then run this again:
  $(root_install_hint "$missing")"
  fi
}

python_ok() {
  "$1" -c "import sys; v = sys.version_info[:2]; sys.exit(not ((${PYTHON_MIN%.*}, ${PYTHON_MIN#*.}) <= v <= (${PYTHON_MAX%.*}, ${PYTHON_MAX#*.})))" 2>/dev/null
}

# A system Python between PYTHON_MIN and PYTHON_MAX, or nothing (then uv provides one).
find_python() {
  PY=""
  if [ -n "${UNSLOTH_PYTHON:-}" ]; then
    python_ok "$UNSLOTH_PYTHON" || die "UNSLOTH_PYTHON=$UNSLOTH_PYTHON is not a Python $PYTHON_MIN to $PYTHON_MAX"
    PY=$UNSLOTH_PYTHON
    return
  fi
  for candidate in python3 python3.13 python3.12 python3.11 python3.10 python; do
    if have "$candidate" && python_ok "$candidate"; then
      PY=$(command -v "$candidate")
      return
    fi
  done
  say "No Python $PYTHON_MIN to $PYTHON_MAX found: uv will provide Python $PYTHON_DEFAULT."
}

# A Python that can make a venv with pip gets uv from the package index (your pip configuration).
python_has_pip_venv() {
  [ -n "$PY" ] && "$PY" -c "import venv, ensurepip" 2>/dev/null
}

uv_ok() {
  version=$("$1" --version 2>/dev/null | awk '{print $2}') || return 1
  [ -n "$version" ] || return 1
  major=${version%%.*}
  rest=${version#*.}
  minor=${rest%%.*}
  [ "$major" -gt "${UV_MIN%.*}" ] || { [ "$major" -eq "${UV_MIN%.*}" ] && [ "$minor" -ge "${UV_MIN#*.}" ]; }
}

find_uv() {
  UV=""
  for candidate in "${UNSLOTH_UV:-}" "$BOOT/bin/uv" "$UNSLOTH_HOME/uv/uv" uv; do
    if [ -n "$candidate" ] && have "$candidate" && uv_ok "$candidate"; then
      UV=$(command -v "$candidate")
      return
    fi
  done
}

download() {
  if have curl; then curl -fsSL --retry 3 -o "$2" "$1"
  else wget -q -O "$2" "$1"
  fi
}

sha256_of() {
  if have sha256sum; then sha256sum "$1" | awk '{print $1}'
  else shasum -a 256 "$1" | awk '{print $1}'
  fi
}

uv_target() {
  case "$OS/$ARCH" in
    linux/x86_64 | wsl/x86_64) echo x86_64-unknown-linux-gnu ;;
    linux/aarch64 | wsl/aarch64 | linux/arm64) echo aarch64-unknown-linux-gnu ;;
    macos/arm64) echo aarch64-apple-darwin ;;
    macos/x86_64) echo x86_64-apple-darwin ;;
    *) die "no uv build for $OS/$ARCH: install Python $PYTHON_MIN+ with venv and pip, then run this again" ;;
  esac
}

# uv $UV_VERSION's PyPI wheel for a target: "URL SHA256", both as PyPI's index lists them. The hash is
# pinned here, beside the version, never fetched from where uv comes from; a new UV_VERSION brings new rows
# (https://pypi.org/simple/uv/). install.ps1 pins the Windows wheels the same way.
uv_wheel() {
  files=https://files.pythonhosted.org/packages
  case "$1" in
    x86_64-unknown-linux-gnu) echo "$files/3d/aa/26d64642d808de4a652579ef950d7cd2d37f080a8babf9c67c6b75fc4c3f/uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19" ;;
    aarch64-unknown-linux-gnu) echo "$files/57/15/94b6cd62ac3ff6550288328e8035288875197cbc183f51554b266a69877b/uv-0.13.9-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.musllinux_1_1_aarch64.whl 5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe" ;;
    aarch64-apple-darwin) echo "$files/f3/a7/a8d7b074798c7fb3b26b37584b8fe2e29df2ccdc24ce7902caab2a53edbf/uv-0.13.9-py3-none-macosx_11_0_arm64.whl 66c512266d633bef48384a1f53003f41f2a8e7b36fe6e7fbfd3e0fd52d96fa63" ;;
    x86_64-apple-darwin) echo "$files/1e/db/08e9ef4879bd667e6d7b4705e594e5bd3e4585f10fc63cb16b9fa2fac63e/uv-0.13.9-py3-none-macosx_10_12_x86_64.whl c16ed11e013557536b3e60065f1b912f6407bd6518e041b961e23ef9e6b4fbf5" ;;
  esac
}

can_unzip_with_tar() {
  case "$(tar --version 2>/dev/null)" in *bsdtar*) return 0 ;; *) return 1 ;; esac
}

# A wheel is a zip: unzip, any Python's zipfile (no pip needed), or a tar that reads zips (bsdtar).
unzip_to() {
  if have unzip; then unzip -q -o "$1" -d "$2"
  elif have python3; then python3 -m zipfile -e "$1" "$2"
  elif can_unzip_with_tar; then tar -xf "$1" -C "$2"
  else return 1
  fi
}

# The standalone uv: its PyPI wheel, checked against the pinned sha256 before anything is unpacked.
# UNSLOTH_UV_DOWNLOAD_URL: a folder (mirror) holding the same wheel; UNSLOTH_UV_SHA256: another build's hash.
download_uv() {
  target=$(uv_target)
  read -r url pinned <<EOF
$(uv_wheel "$target")
EOF
  wheel=${url##*/}
  if [ -n "${UNSLOTH_UV_DOWNLOAD_URL:-}" ]; then url="${UNSLOTH_UV_DOWNLOAD_URL%/}/$wheel"; fi
  expected=${UNSLOTH_UV_SHA256:-$pinned}
  tmp=$(mktemp -d)
  say "Downloading uv $UV_VERSION ($target)"
  download "$url" "$tmp/$wheel" || { rm -rf "$tmp"; die "could not download $url (network or proxy?); nothing was installed"; }
  actual=$(sha256_of "$tmp/$wheel")
  if [ "$actual" != "$expected" ]; then
    rm -rf "$tmp"
    die "the uv download from $url is corrupt or tampered with (sha256 $actual, expected $expected); nothing was installed. Run this again; behind a mirror that rebuilds wheels, set UNSLOTH_UV_SHA256 to its hash"
  fi
  unzip_to "$tmp/$wheel" "$tmp/uv" && [ -f "$tmp/uv/uv-$UV_VERSION.data/scripts/uv" ] ||
    { rm -rf "$tmp"; die "could not unpack $wheel (install unzip); nothing was installed"; }
  mkdir -p "$UNSLOTH_HOME/uv"
  chmod 755 "$tmp/uv/uv-$UV_VERSION.data/scripts/uv"
  mv "$tmp/uv/uv-$UV_VERSION.data/scripts/uv" "$UNSLOTH_HOME/uv/uv.partial"
  mv "$UNSLOTH_HOME/uv/uv.partial" "$UNSLOTH_HOME/uv/uv"  # whole or not at all under its final name
  rm -rf "$tmp"
  UV="$UNSLOTH_HOME/uv/uv"
}

# Where this package comes from: this clone, an explicit source, or the release archive.
resolve_source() {
  if [ -n "${UNSLOTH_SOURCE:-}" ]; then
    SOURCE=$UNSLOTH_SOURCE
    return
  fi
  here=""
  case $0 in
    */install.sh | install.sh) here=$(cd "$(dirname "$0")" && pwd) ;;
  esac
  if [ -n "$here" ] && [ -f "$here/pyproject.toml" ] && grep -q '^name = "unsloth-installer"' "$here/pyproject.toml"; then
    SOURCE=$here
  elif [ -n "${UNSLOTH_VERSION:-}" ] && [ "$UNSLOTH_VERSION" != latest ]; then
    SOURCE="$RELEASES/download/v$UNSLOTH_VERSION/unsloth_installer-$UNSLOTH_VERSION.tar.gz"
  else
    SOURCE="$RELEASES/latest/download/unsloth_installer.tar.gz"
  fi
  export UNSLOTH_SOURCE="$SOURCE"
}

confirm() {
  if [ "${UNSLOTH_YES:-0}" = 1 ] || ! [ -t 1 ] || ! { : </dev/tty; } 2>/dev/null; then
    return 0
  fi
  printf '%s' "Install unsloth into $UNSLOTH_HOME (launcher in ${UNSLOTH_BIN_DIR:-$HOME/.local/bin})? [Y/n] "
  read -r answer </dev/tty || answer=n
  case $answer in
    "" | y | Y | yes) return 0 ;;
    *) say "Nothing changed."; exit 1 ;;
  esac
}

# The same lock as `unsloth install` (flock(2) on $UNSLOTH_HOME/install.lock), held from here to the
# end: a concurrent run waits, then finds the bootstrap and the managed environment in place. The
# `unsloth install` started below counts it as its own (UNSLOTH_LOCK_OWNER names this shell).
take_lock() {
  lock="$UNSLOTH_HOME/install.lock"
  exec 9>>"$lock" || die "cannot open $lock: check that $UNSLOTH_HOME is yours and writable"
  if ! lock_fd9 nowait; then
    say "Another unsloth install is running (pid $(cat "$lock" 2>/dev/null)); waiting for it to finish..."
    lock_fd9 || die "could not lock $lock"
  fi
  printf '%s' "$$" >"$lock"
  UNSLOTH_LOCK_OWNER=$$
  export UNSLOTH_LOCK_OWNER
}

# flock(2) on this shell's fd 9, by whichever tool is here: the lock belongs to the open file, which
# this shell keeps open, so it lasts until the shell ends (or is killed) even though the tool exits.
lock_fd9() {
  if have flock; then
    if [ -n "${1:-}" ]; then flock -n 9; else flock 9; fi
  elif have perl; then
    perl -e 'use Fcntl qw(:flock); open(my $fh, ">&=", 9) or exit 2; exit(flock($fh, LOCK_EX | ($ARGV[0] ? LOCK_NB : 0)) ? 0 : 1)' "${1:+1}"
  elif [ -n "$PY" ]; then
    "$PY" -c 'import fcntl, sys; fcntl.flock(9, fcntl.LOCK_EX | (fcntl.LOCK_NB if sys.argv[1:] != [""] else 0))' "${1:+1}" 2>/dev/null
  else
    warn "no flock, perl or Python to lock $lock with: start no other install until this one ends"
  fi
}

# The bootstrap environment: uv and this package, enough to run `unsloth install`.
ensure_bootstrap() {
  if [ -x "$BOOT/bin/python" ] && "$BOOT/bin/python" -c "" 2>/dev/null; then
    :
  elif python_has_pip_venv; then
    say "Creating the bootstrap environment with $PY"
    rm -rf "$BOOT"
    "$PY" -m venv "$BOOT" || { rm -rf "$BOOT"; die "$PY could not create a venv. $(root_install_hint python3-venv)"; }
  else
    find_uv
    [ -n "$UV" ] || download_uv
    say "Creating the bootstrap environment with uv"
    rm -rf "$BOOT"
    "$UV" venv --quiet --python "${PY:-$PYTHON_DEFAULT}" "$BOOT" || { rm -rf "$BOOT"; die "uv could not provide a Python"; }
  fi
  say "Installing unsloth into the bootstrap environment from $SOURCE"
  # shellcheck disable=SC2046 # one word per flag and value: URLs and paths have no spaces here
  if [ -x "$BOOT/bin/uv" ] &&
    "$BOOT/bin/uv" pip install --quiet --python "$BOOT/bin/python" $(index_args) --reinstall-package unsloth-installer "$SOURCE" 2>/dev/null; then
    : # a re-run: uv refreshes this package in seconds (its build backend is in uv's cache)
  elif "$BOOT/bin/python" -m pip --version >/dev/null 2>&1; then
    # pip reads your pip configuration itself; UNSLOTH_* overrides go on top.
    # shellcheck disable=SC2046 # one word per flag and value: URLs and paths have no spaces here
    "$BOOT/bin/python" -m pip install --quiet --disable-pip-version-check $(index_args) uv "$SOURCE" ||
      die "installing unsloth into $BOOT failed (output above). Check the network or UNSLOTH_INDEX_URL; your environment is unchanged."
  else
    find_uv
    # shellcheck disable=SC2046 # as above
    "$UV" pip install --quiet --python "$BOOT/bin/python" $(index_args) --reinstall-package unsloth-installer uv "$SOURCE" ||
      die "installing unsloth into $BOOT failed (output above); your environment is unchanged."
  fi
}

# UNSLOTH_* index overrides as flags that pip and uv both read.
index_args() {
  if [ -n "${UNSLOTH_INDEX_URL:-}" ]; then printf ' --index-url %s' "$UNSLOTH_INDEX_URL"; fi
  for url in ${UNSLOTH_EXTRA_INDEX_URL:-}; do printf ' --extra-index-url %s' "$url"; done
  for link in ${UNSLOTH_FIND_LINKS:-}; do printf ' --find-links %s' "$link"; done
}

main() {
  parse_args "$@"
  shift $(($# - PASSTHROUGH_COUNT))
  detect_os
  UNSLOTH_HOME=${UNSLOTH_HOME:-$(default_home)}
  export UNSLOTH_HOME
  BOOT="$UNSLOTH_HOME/bootstrap"
  find_python
  find_uv
  NEED_DOWNLOAD=0
  if ! python_has_pip_venv && [ -z "$UV" ] && ! [ -x "$BOOT/bin/python" ]; then NEED_DOWNLOAD=1; fi
  check_tools
  resolve_source

  if [ "$DRY_RUN" = 1 ]; then
    say "Dry run: nothing will change."
    say "install home: $UNSLOTH_HOME"
    say "package source: $SOURCE"
    if [ -n "$PY" ]; then say "Python: $PY"; else say "Python: $PYTHON_DEFAULT, provided by uv"; fi
    if [ -n "$UV" ]; then say "uv: $UV"; elif python_has_pip_venv; then say "uv: from the package index, through pip"; else say "uv: standalone download $UV_VERSION"; fi
    if [ -x "$BOOT/bin/unsloth" ]; then
      say "The plan for this machine:"
      "$BOOT/bin/unsloth" install --dry-run "$@"
    else
      say "The plan for this machine is shown by \`unsloth install --dry-run\` once the bootstrap exists."
    fi
    return 0
  fi

  confirm
  mkdir -p "$UNSLOTH_HOME"
  take_lock
  ensure_bootstrap
  say "Handing over to \`unsloth install\` for the hardware-aware rest"
  before=$(cat "$UNSLOTH_HOME/current" 2>/dev/null || true)
  "$BOOT/bin/unsloth" install --yes "$@" || die "unsloth install failed (see above); anything already installed is unchanged."
  launcher="${UNSLOTH_BIN_DIR:-$HOME/.local/bin}/unsloth"
  if [ -n "$before" ] && [ "$before" = "$(cat "$UNSLOTH_HOME/current" 2>/dev/null)" ]; then
    say "Nothing changed. \`$launcher doctor\` checks the environment at any time."
    return 0
  fi
  say "Checking the result with \`unsloth doctor\`"
  "$launcher" doctor || die "unsloth doctor found a problem (see above); fix it, then run \`$launcher doctor\` again."
  say "Done. Run: $launcher train --demo"
}

main "$@"
