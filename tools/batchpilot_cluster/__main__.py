"""``python -m batchpilot_cluster build|up|down|status|images|import``: the test cluster (and the
project's container images) from a shell."""

import argparse
import sys
import time
from pathlib import Path

from batchpilot_cluster import building, controlplane, images, locations, realnodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_cluster", description=__doc__)
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="run state (default: $BATCHPILOT_E2E_STATE or <repo>/.run/cluster)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the binaries, once per version")
    build_parser.add_argument("--force", action="store_true", help="rebuild even if current")
    up_parser = commands.add_parser("up", help="build if needed, then start a cluster")
    up_parser.add_argument("--nodes", type=int, default=1, help="kwok nodes (default 1)")
    up_parser.add_argument(
        "--real-nodes",
        type=int,
        default=controlplane.E2E_REAL_NODES,
        help=f"real nodes, containerd and a kubelet each (default {controlplane.E2E_REAL_NODES})",
    )
    down_parser = commands.add_parser("down", help="stop everything and delete the state dir")
    down_parser.add_argument("--keep-logs", action="store_true", help="keep <state>/logs")
    commands.add_parser("status", help="say whether a cluster is up, and where")
    images_parser = commands.add_parser(
        "images", help="build the container images as OCI archives, once per input hash"
    )
    images_parser.add_argument(
        "names", nargs="*", metavar="NAME", help="only these (default: all)", default=None
    )
    import_parser = commands.add_parser(
        "import", help="import OCI archives into every real node's containerd (no registry here)"
    )
    import_parser.add_argument("archives", nargs="+", type=Path, help="OCI archive files")
    args = parser.parse_args(argv)
    state_dir: Path = (args.state_dir or locations.state_dir()).resolve()

    if args.command == "images":
        return build_images(args.names or None)
    try:
        if args.command in ("build", "up"):
            report = building.build(force=args.command == "build" and args.force)
            what = ", ".join(report.built) if report.built else "nothing (all current)"
            print(f"build: {report.seconds:.1f} s, built {what}, in {report.bin_dir}")
        if args.command == "up":
            if controlplane.is_up(state_dir):
                print(f"already up; KUBECONFIG={state_dir / 'kubeconfig'}")
                return 0
            controlplane.start(state_dir=state_dir, nodes=args.nodes, real_nodes=args.real_nodes)
        elif args.command == "down":
            controlplane.stop(state_dir=state_dir, keep_logs=args.keep_logs)
        elif args.command == "status":
            if not controlplane.is_up(state_dir):
                print(f"down ({state_dir})")
                return 1
            print(controlplane.Cluster.load(state_dir).to_json())
        elif args.command == "import":
            if not controlplane.is_up(state_dir):
                print(f"error: no cluster up in {state_dir}", file=sys.stderr)
                return 1
            ctr = building.require_binaries() / "ctr"
            for node in controlplane.Cluster.load(state_dir).real_nodes:
                for archive in args.archives:
                    realnodes.import_image(node, ctr=ctr, archive=archive)
                    print(f"imported {archive} into {node.name}")
    except (building.BuildError, controlplane.ClusterError, realnodes.NodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def build_images(names: list[str] | None) -> int:
    started = time.monotonic()
    try:
        built = images.build(names)
    except images.ImageError as error:
        print(f"images: {error}", file=sys.stderr)
        return 1
    for image in built:
        print(images.describe(image))
        print(images.describe_contents(images.recipe_named(image.name), image))
    fresh = [image.name for image in built if not image.cached]
    what = ", ".join(fresh) if fresh else "nothing (all current)"
    print(f"images: {time.monotonic() - started:.1f} s, built {what}, in {images.images_root()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
