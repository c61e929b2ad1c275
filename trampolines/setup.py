"""Packaging glue that pyproject.toml cannot express: the cffi extension and
the start-up .pth file (installed at the top of site-packages)."""

from pathlib import Path

from setuptools import setup

try:
    import cffi  # noqa: F401  (setuptools ignores cffi_modules without it)
except ImportError as exc:
    # Without this, a build with --no-build-isolation and no cffi "succeeds"
    # with a wheel that holds no runtime at all.
    raise SystemExit("tramprof-trampolines: building the runtime needs cffi "
                     "(pip install cffi, or Debian's python3-cffi)") from exc
from setuptools.command.build_py import build_py

PTH = "tramprof_trampolines.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / PTH
        self.copy_file(str(source), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(
    cffi_modules=["src/build.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithPth},
)
