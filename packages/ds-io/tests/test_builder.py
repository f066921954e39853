"""The async_io op on ds-ops' builder: registered for ds-report, and honest about libaio."""

from __future__ import annotations

from ds_io import AsyncIOBuilder
from ds_io.op_builder import LIBAIO_FIX, libaio_status
from ds_ops.report import all_builders


def test_registered_for_ds_report():
    assert all_builders()["async_io"] is AsyncIOBuilder


def test_without_libaio_the_op_is_still_compatible_and_says_why(monkeypatch):
    monkeypatch.setenv("DS_IO_NO_LIBAIO", "1")
    ok, note = AsyncIOBuilder().compatibility()
    assert ok and note.startswith("DS_IO_NO_LIBAIO=1: built on a pread/pwrite thread pool") and LIBAIO_FIX in note
    assert "DS_IO_HAVE_LIBAIO" not in " ".join(AsyncIOBuilder().cxx_flags())
    assert "-laio" not in AsyncIOBuilder().ldflags()


def test_with_libaio_present_it_is_linked():
    builder = AsyncIOBuilder()
    if libaio_status():
        assert "-laio" not in builder.ldflags()
    else:
        assert "-DDS_IO_HAVE_LIBAIO" in builder.cxx_flags() and "-laio" in builder.ldflags()
        assert builder.load().have_libaio()
