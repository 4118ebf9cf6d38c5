#!/usr/bin/env bash
# Installs what building cudp needs on Debian or Ubuntu, in one apt-get run: the build tools, the
# libraries cmake/Dependencies.cmake looks for, the image decoders cudp opens at run time for
# `--data folder`, and the Fashion-MNIST files cudp-vgg trains on by default. Packages already
# installed are skipped, so on a ready machine it changes nothing and needs no network. cuDNN, NCCL
# and the CUDA toolkit come from NVIDIA's CUDA repository; where that repository is not configured
# the script says how to add it instead of guessing.
#
#   scripts/setup-debian.sh            install what is missing (uses sudo when not root)
#   scripts/setup-debian.sh --check    only list what is missing; exit 1 if anything is
#   scripts/setup-debian.sh --no-data  leave out dataset-fashion-mnist
set -euo pipefail

check_only=0
with_data=1
for arg in "$@"; do
  case $arg in
    --check) check_only=1 ;;
    --no-data) with_data=0 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup-debian.sh: unknown option '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

# From Debian/Ubuntu: build tools, then the libraries (tests: GoogleTest; programs and benchmarks:
# CLI11; library: zlib and nlohmann-json; JPEG and PNG decoding, opened at
# run time by data/image_folder.cpp: libjpeg-turbo and libpng; launching one process per GPU,
# optional at configure time: Open MPI).
packages=(cmake ninja-build g++ zlib1g-dev nlohmann-json3-dev libgtest-dev libcli11-dev
          libturbojpeg0 libpng16-16 libopenmpi-dev openmpi-bin)
((with_data)) && packages+=(dataset-fashion-mnist)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep "install ok installed" >/dev/null; }
missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done

# From NVIDIA's repository, checked by file rather than by package name: a toolkit installed from
# NVIDIA's .run installer or a tarball is as good as its packages.
have_file() {
  local f
  for f in "$@"; do [[ -e $f ]] && return 0; done
  return 1
}
nvidia=()
if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  nvidia+=(cuda-toolkit-13-0)
fi
have_file /usr/include/nccl.h /usr/local/cuda/include/nccl.h /usr/local/include/nccl.h \
  || nvidia+=(libnccl-dev)
have_file /usr/include/cudnn.h /usr/include/x86_64-linux-gnu/cudnn.h /usr/local/cuda/include/cudnn.h \
  /usr/local/include/cudnn.h || nvidia+=(libcudnn9-dev-cuda-13)
missing+=("${nvidia[@]}")

if ((${#missing[@]} == 0)); then
  echo "setup-debian.sh: everything cudp needs is installed"
  exit 0
fi
echo "setup-debian.sh: missing: ${missing[*]}"
((check_only)) && exit 1

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "setup-debian.sh: run as root or install sudo" >&2; exit 1; }
  sudo=(sudo)
fi
"${sudo[@]}" apt-get update

if ((${#nvidia[@]})); then
  unknown=()
  for p in "${nvidia[@]}"; do
    apt-cache show "$p" >/dev/null 2>&1 || unknown+=("$p")
  done
  if ((${#unknown[@]})); then
    cat >&2 <<EOF
setup-debian.sh: apt knows no package ${unknown[*]}: NVIDIA's CUDA repository is not configured.
Add it (https://developer.nvidia.com/cuda-downloads, "deb (network)": install its cuda-keyring
package), then run this script again.
EOF
    exit 1
  fi
fi

"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"

# Debian 12 and Ubuntu 24.04 ship CMake >= 3.25; older releases need a newer one (Kitware's apt
# repository, or pip install cmake).
version=$(cmake --version | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
if [[ $(printf '%s\n' 3.25 "$version" | sort -V | head -n1) != 3.25 ]]; then
  echo "setup-debian.sh: cmake $version is older than the 3.25 cudp needs" >&2
  exit 1
fi
if ! command -v nvcc >/dev/null; then
  echo "setup-debian.sh: done (nvcc is in /usr/local/cuda/bin; cudp's configuration looks there)"
else
  echo "setup-debian.sh: done"
fi
