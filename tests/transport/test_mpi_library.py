"""What the MPI library says of itself (``burstmpi._transport.mpi_library``)."""

from mpi4py import MPI

from burstmpi._transport import mpi_library


def test_the_library_is_named_by_its_first_words():
    name = mpi_library.library_name()
    assert name and "\n" not in name and "  " not in name
    assert MPI.Get_library_version().split()[0] in name


def test_cuda_support_is_asked_of_the_loaded_library(tmp_path):
    """Every pip MPI (MPICH, Open MPI, Intel MPI) answers; none of their wheels has CUDA.
    Where no libmpi is mapped there is no one to ask."""
    got = mpi_library.cuda_support.__wrapped__()
    assert got in (True, False)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 00:1a 1 /usr/lib/libc.so.6\n")
    assert mpi_library.cuda_support.__wrapped__(str(maps)) is None
