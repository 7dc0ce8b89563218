"""Write a directory tree as an OCI image archive (one layer), with the standard library only.

    python3 containers/oci_archive.py ROOT OUT.tar [--env NAME=VALUE]... [--tag NAME:TAG]

The archive is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) in a
tar: what ``podman load``, ``skopeo copy oci-archive:OUT.tar ...`` and ``apptainer build x.sif
oci-archive://OUT.tar`` read. The layer is an uncompressed tar of ROOT (numeric owners kept,
sockets skipped); the image config carries the environment and ``python -m hvdtrain.cnn`` as its
command. Written under a temporary name and renamed, so a failed run leaves no archive.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import stat
import sys
import tarfile
import tempfile
import time

LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le"}


class HashingWriter(io.RawIOBase):
    """A file that counts and hashes what is written to it."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.file.write(data)
        self.sha256.update(data)
        self.size += len(data)
        return len(data)


def write_layer(root: str, out) -> tuple[str, int]:
    """An uncompressed tar of ``root``'s contents into ``out`` -> (sha256 digest, size)."""
    writer = HashingWriter(out)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as layer:
        for directory, subdirectories, files in os.walk(root):
            subdirectories.sort()
            for name in sorted(subdirectories) + sorted(files):
                path = os.path.join(directory, name)
                mode = os.lstat(path).st_mode
                if stat.S_ISSOCK(mode):
                    continue  # a socket left by the build: nothing an image can hold
                info = layer.gettarinfo(path, arcname=os.path.relpath(path, root))
                info.uname = info.gname = ""  # numeric owners: the image's, not this machine's
                if info.isreg():
                    with open(path, "rb") as content:
                        layer.addfile(info, content)
                else:
                    layer.addfile(info)
    return f"sha256:{writer.sha256.hexdigest()}", writer.size


def blob(data: bytes) -> tuple[str, int]:
    return f"sha256:{hashlib.sha256(data).hexdigest()}", len(data)


def add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    archive.addfile(info, io.BytesIO(data))


def write_archive(root: str, out_path: str, env: list[str], tag: str) -> str:
    """ROOT as an OCI archive at ``out_path``; returns the manifest's digest."""
    directory = os.path.dirname(os.path.abspath(out_path))
    with tempfile.TemporaryFile(dir=directory) as layer_file:
        layer_digest, layer_size = write_layer(root, layer_file)
        config = json.dumps({
            "architecture": ARCHITECTURES.get(os.uname().machine, os.uname().machine),
            "os": "linux",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": {"Env": env, "Cmd": ["python", "-m", "hvdtrain.cnn"],
                       "WorkingDir": "/opt/hvdtrain"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created_by": "containers/build.sh (debootstrap + scripts/install.sh)"}],
        }, indent=1).encode()
        config_digest, config_size = blob(config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer_digest, "size": layer_size}],
        }, indent=1).encode()
        manifest_digest, manifest_size = blob(manifest)
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": MANIFEST_TYPE, "digest": manifest_digest, "size": manifest_size,
            "annotations": {"org.opencontainers.image.ref.name": tag}}]}, indent=1).encode()
        partial = out_path + ".partial"
        try:
            with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
                add_bytes(archive, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
                add_bytes(archive, "index.json", index)
                for digest, data in ((config_digest, config), (manifest_digest, manifest)):
                    add_bytes(archive, f"blobs/sha256/{digest.split(':')[1]}", data)
                info = tarfile.TarInfo(f"blobs/sha256/{layer_digest.split(':')[1]}")
                info.size, info.mtime, info.mode = layer_size, int(time.time()), 0o644
                layer_file.seek(0)
                archive.addfile(info, layer_file)
            os.replace(partial, out_path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return manifest_digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the image's root directory")
    parser.add_argument("out", help="the archive to write (e.g. hvdtrain-cpu.oci.tar)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the image (repeatable)")
    parser.add_argument("--tag", default="hvdtrain:cpu",
                        help="the reference name recorded in index.json")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"oci_archive: {args.root} is not a directory", file=sys.stderr)
        return 2
    digest = write_archive(args.root, args.out, args.env, args.tag)
    print(f"oci_archive: wrote {args.out} (manifest {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
