#!/bin/sh
# `make images`: build the Infera image and the engine overlays with docker or podman.
#
# Environment (make passes its variables of the same names; all optional):
#   IMAGES            which to build, from: infera vllm sglang atom (default: all four)
#   VERSION           image tag (default: the version in pyproject.toml)
#   REGISTRY          registry host, or host/path (default: ghcr.io; empty: local names only)
#   IMAGE_NAMESPACE   the names' namespace (default: infera). Names are
#                     <REGISTRY>/<IMAGE_NAMESPACE>/infera-vllm:<VERSION>; the defaults give the images
#                     the operator's renderer names (ghcr.io/infera/infera-vllm:<VERSION>).
#   PUSH=1            push every image after all of them are built
#   CONTAINER_ENGINE  docker, podman or a path (default: docker if installed, else podman)
#   VLLM_BASE_IMAGE, SGLANG_BASE_IMAGE, ATOM_BASE_IMAGE, PYTHON_IMAGE
#                     base images; unset or empty keeps each Dockerfile's default
set -eu

fail() {
    echo "make images: $*" >&2
    exit 1
}

cd "$(dirname "$0")/../.."  # the build context: the repository root

engine=${CONTAINER_ENGINE:-}
if [ -z "$engine" ]; then
    engine=$(command -v docker || command -v podman || true)
    [ -n "$engine" ] || fail "neither docker nor podman is installed; install one of them, or name one with CONTAINER_ENGINE=..."
elif ! command -v "$engine" >/dev/null 2>&1; then
    fail "CONTAINER_ENGINE=$engine is not installed"
fi
# docker needs a reachable daemon (podman runs without one); `info` fails fast when it is not there.
"$engine" info >/dev/null 2>&1 \
    || fail "$engine is installed but cannot reach a container engine ('$engine info' failed): start the daemon, or point DOCKER_HOST / CONTAINER_HOST at one"

version=${VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
[ -n "$version" ] || fail "no VERSION given and none found in pyproject.toml"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
registry=${REGISTRY-ghcr.io}  # set but empty: no registry part
prefix="${registry:+${registry%/}/}${IMAGE_NAMESPACE:-infera}"
images=${IMAGES:-infera vllm sglang atom}
for image in $images; do  # every name checked before anything is built
    case $image in
        infera | vllm | sglang | atom) ;;
        *) fail "IMAGES: unknown image '$image' (choose from: infera vllm sglang atom)" ;;
    esac
done

# A base image is passed only when set, so the Dockerfile's default applies otherwise.
base_arg() {
    [ -z "$2" ] || printf -- '--build-arg\n%s=%s\n' "$1" "$2"
}

built=""
for image in $images; do
    case $image in
        infera) dockerfile=Dockerfile name=infera base=$(base_arg PYTHON_IMAGE "${PYTHON_IMAGE:-}") ;;
        vllm) dockerfile=Dockerfile.vllm name=infera-vllm base=$(base_arg VLLM_BASE_IMAGE "${VLLM_BASE_IMAGE:-}") ;;
        sglang) dockerfile=Dockerfile.sglang name=infera-sglang base=$(base_arg SGLANG_BASE_IMAGE "${SGLANG_BASE_IMAGE:-}") ;;
        atom) dockerfile=Dockerfile.atom name=infera-atom base=$(base_arg ATOM_BASE_IMAGE "${ATOM_BASE_IMAGE:-}") ;;
    esac
    tag="$prefix/$name:$version"
    echo "make images: building $tag from deploy/images/$dockerfile"
    # $base is one "--build-arg NAME=value" pair on two lines (or nothing): split on newlines only.
    old_ifs=$IFS
    IFS='
'
    # shellcheck disable=SC2086
    "$engine" build -f "deploy/images/$dockerfile" -t "$tag" \
        --build-arg "VERSION=$version" --build-arg "REVISION=$revision" $base .
    IFS=$old_ifs
    built="$built $tag"
done

if [ "${PUSH:-}" = 1 ]; then
    for tag in $built; do
        echo "make images: pushing $tag"
        "$engine" push "$tag"
    done
fi
echo "make images: built$built"
