"""Shared fixtures: the tiny target is built once per test session from a fixed seed (no downloads)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

# Triton kernels run on the CPU through the interpreter; set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dflash_common.tiny import TinySpec, build_tiny_target  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """An 8-layer, hidden-64 Qwen3 target with a byte-level tokenizer whose template marks assistant
    tokens (`{% generation %}`)."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"), TinySpec())


@pytest.fixture(scope="session")
def tiny_target_2layer(tmp_path_factory):
    """A 2-layer, hidden-64 Qwen3 target (tied embeddings, template without generation markers)."""
    spec = TinySpec(num_layers=2, tie_word_embeddings=True, generation_markers=False, seed=1)
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target-2l"), spec)


class SmallDisk:
    """A tmpfs of a given size mounted for one test: a real filesystem that fills up."""

    def __init__(self, path):
        self.path = path

    def resize(self, size: str) -> None:
        """Grow (or shrink) it in place, files kept: 'space is freed'."""
        done = subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@pytest.fixture()
def small_disk(tmp_path):
    """small_disk(size) -> a SmallDisk of `size` (tmpfs syntax: '1200k', '2m'); skips the test where
    mounting is not allowed (the fault tests inject the same errors without it)."""
    mounted = []

    def mount(size: str) -> SmallDisk:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); the injected test still runs")
        mounted.append(path)
        return SmallDisk(path)

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(params=["read-only filesystem", "immutable directory"])
def unwritable_dir(request, tmp_path):
    """A directory nothing can be written into, root included (root ignores mode bits): a tmpfs
    mounted read-only, or a directory with the immutable flag (`chattr +i`; as a user without root,
    mode 0555 does). Skips where this machine allows neither."""
    path = tmp_path / "unwritable"
    path.mkdir()
    if request.param == "read-only filesystem":
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here ({done.stderr.strip()})")
        undo = ["umount", "-l", str(path)]
    elif os.geteuid() != 0:
        path.chmod(0o555)
        undo = ["chmod", "755", str(path)]
    else:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a directory immutable here ({done.stderr.strip()})")
        undo = ["chattr", "-i", str(path)]
    try:
        (path / "probe").touch()
    except OSError:
        pass
    else:
        subprocess.run(undo, capture_output=True)
        pytest.skip(f"a {request.param} here still takes new files")
    yield path
    subprocess.run(undo, capture_output=True)
