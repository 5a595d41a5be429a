"""One model's `vkrt serve`, started by the multi-model server: `python -m vkrt.serve_models.child FD`.

The parent passes a listening socket (file descriptor FD, bound to a free loopback port before the
child starts, so there is no race for the port) and the pickled ServerConfig on standard input
(the API key included: nothing secret on the command line). A failure is one line on standard
error, `vkrt: error: ...`, and exit status 1, which the parent shows to the model's clients.
"""

from __future__ import annotations

import logging
import pickle
import socket
import sys

from vkrt import config as env
from vkrt.errors import VkrtError


def main(argv: list[str]) -> int:
    fd = int(argv[0])
    config = pickle.load(sys.stdin.buffer)
    # As the CLI logs, with the model's name: the parent passes these lines on to its own stderr.
    logging.basicConfig(level=getattr(logging, env.log_level(), logging.WARNING), stream=sys.stderr,
                        format=f"vkrt [{config.served_model_name}]: %(levelname)s: %(message)s")
    from vkrt.server import serve

    try:
        serve(config, sock=socket.socket(fileno=fd))
    except VkrtError as exc:
        print(f"vkrt: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
