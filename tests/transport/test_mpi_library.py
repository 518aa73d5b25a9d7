"""What the MPI library says of itself (``burstmpi._transport.mpi_library``)."""

from mpi4py import MPI

from burstmpi._transport import mpi_library


def test_the_library_is_named_by_its_first_words(monkeypatch):
    name = mpi_library.library_name()
    assert name and "\n" not in name and "  " not in name
    assert MPI.Get_library_version().split()[0] in name
    # Open MPI 5.0.11's version string ends in its C string's NUL: not printed on.
    monkeypatch.setattr(mpi_library.MPI, "Get_library_version", lambda: "Open MPI v5.0.11, package: x\0")
    assert mpi_library.library_version() == "Open MPI v5.0.11, package: x"
    assert mpi_library.library_name() == "Open MPI v5.0.11"


def test_cuda_support_is_asked_of_the_loaded_library(tmp_path):
    """Every pip MPI (MPICH, Open MPI, Intel MPI) answers; none of their wheels has CUDA.
    Where no libmpi is mapped there is no one to ask."""
    got = mpi_library.cuda_support.__wrapped__()
    assert got in (True, False)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 00:1a 1 /usr/lib/libc.so.6\n")
    assert mpi_library.cuda_support.__wrapped__(str(maps)) is None
