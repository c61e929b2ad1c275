"""Make cffi's ``_cffi_backend`` importable while ``site`` runs .pth files.

.pth files run while ``site`` is still adding directories to sys.path. When
this package sits in a directory processed before the one holding
``_cffi_backend`` (a venv with --system-site-packages, a user site), the
backend is not importable yet: load it from the site directory where it
would be found a moment later, without touching sys.path.
"""

import os
import sys


def preload_cffi_backend() -> None:
    try:
        import _cffi_backend  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.machinery
    import importlib.util
    import site

    for directory in site.getsitepackages():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directory, "_cffi_backend" + suffix)
            if os.path.isfile(path):
                spec = importlib.util.spec_from_file_location("_cffi_backend", path)
                if spec is None or spec.loader is None:
                    continue
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules["_cffi_backend"] = module
                return

