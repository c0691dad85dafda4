"""Build hook: generate the gRPC stubs from deploy/proto at build/install time.

Everything else about the package is in pyproject.toml. The stubs are written next to
the .proto (deploy/proto/folio/v1/*_pb2*.py, ignored by git) and never edited by hand.
"""

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_stubs() -> None:
    from grpc_tools import protoc

    import grpc_tools

    root = os.path.join(HERE, "deploy", "proto")
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    for proto in glob.glob(os.path.join(root, "folio", "v1", "*.proto")):
        rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={root}",
                          f"--grpc_python_out={root}", f"--pyi_out={root}", proto])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
