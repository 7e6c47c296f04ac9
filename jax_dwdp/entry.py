"""The jax-dwdp console script: the CLI (jax_dwdp.cli), with Ctrl-C covered while jax is still importing.

Importing jax takes seconds, and a Ctrl-C inside jaxlib's extension initialisation surfaces as an ImportError
traceback, past the CLI's own KeyboardInterrupt handling. So the jax import happens here first (after the
arguments parse: --help and usage errors stay instant), under a SIGINT handler that prints one line and exits
130 at once (nothing has been done yet); the CLI then runs with Python's usual handler, which it relies on to
clean up (a conversion's partial folder, for one).
"""

import os
import signal
import sys

EXIT_INTERRUPTED = 130  # as jax_dwdp.cli: Ctrl-C, as a shell reports SIGINT


def _interrupted_while_starting(signum, frame):
    os.write(2, b"error: interrupted while starting (importing jax); nothing was done\n")
    os._exit(EXIT_INTERRUPTED)


def main() -> int:
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # an ignored SIGINT (a background job) stays ignored
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    from jax_dwdp import cli, distributed

    args = cli.build_parser().parse_args()
    if args.debug:
        signal.signal(signal.SIGINT, previous)  # --debug: a traceback, as the CLI gives
    distributed.quiet_native_logs(args.verbose)
    import jax  # noqa: F401  (the slow import, under the handler above)

    signal.signal(signal.SIGINT, previous)
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
