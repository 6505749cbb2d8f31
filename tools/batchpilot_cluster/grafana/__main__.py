"""``python -m batchpilot_cluster.grafana build|where``: the test Grafana from a shell (``make
grafana``)."""

import argparse
import sys

from batchpilot_cluster import building as go_building
from batchpilot_cluster.grafana import grafana_builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_cluster.grafana", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the server, once per version")
    build_parser.add_argument("--force", action="store_true", help="rebuild even if current")
    commands.add_parser("where", help="print the binary and home path of the built server")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            report = grafana_builds.build(force=args.force)
            what = "built" if report.built else "nothing to do (current)"
            grafana = report.installation
            print(
                f"grafana: {report.seconds:.1f} s, {what}: Grafana {grafana.version} "
                f"({grafana.commit}) in {grafana.binary.parent}"
            )
        else:
            grafana = grafana_builds.require()
            print(f"{grafana.binary} server --homepath {grafana.home}")
    except go_building.BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
