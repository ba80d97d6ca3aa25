"""``python -m rechunk_p2p``: the ``rechunk-p2p`` command line.

Where it runs: client (the main thread of this process).
"""

from rechunk_p2p.cli import entry

if __name__ == "__main__":
    entry()
