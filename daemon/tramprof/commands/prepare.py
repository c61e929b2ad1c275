"""``tramprof prepare``: compile the BPF program into the program cache, then exit.

The first start on a node's kernel compiles the program in a child process
(bcc, clang and LLVM: ~150 MB) next to the daemon; every later start loads
the cached image (~95 MB in all). Run as an init container with the
daemon's configuration and cache directory, ``prepare`` takes that peak out
of the daemon's container, whose memory limit then only has to cover the
daemon. On a cache hit it loads the cached image once (the kernel's verifier
checks it again) and exits without compiling.

Exit status 0 means the daemon can start: from the cache, or, when the image
could not be kept (a read-only or refused directory, or no
``program_cache_dir``), by compiling as it would have anyway; that is
logged as a warning and must not keep the profiler from starting. 1 means
the program does not compile or load here, which the daemon would fail on too.
"""

from __future__ import annotations

import logging

from tramprof.config import Config
from tramprof.pipeline.profiler import sampler_config
from tramprof.sampler.program import Sampler, SamplerError

log = logging.getLogger(__name__)

EXIT_READY = 0
EXIT_DOES_NOT_LOAD = 1


def prepare(config: Config) -> int:
    """Make sure the program of ``config`` is in its program cache."""
    if not config.program_cache_dir:
        log.warning("program_cache_dir is empty: nothing to prepare, the daemon compiles "
                    "its program at every start")
        return EXIT_READY
    sampler = Sampler(sampler_config(config))
    try:
        sampler.load()
        cached, source = sampler.cached, sampler.loaded_from
    except SamplerError as exc:
        log.error("%s", exc)
        return EXIT_DOES_NOT_LOAD
    finally:
        sampler.close()
    if not cached:
        log.warning("the program compiled and loaded, but could not be kept in %s (see "
                    "above): the daemon will compile it again", config.program_cache_dir)
    else:
        log.info("the program cache in %s is ready (%s)", config.program_cache_dir,
                 "it held the program already" if source == "cache" else "compiled now")
    return EXIT_READY
