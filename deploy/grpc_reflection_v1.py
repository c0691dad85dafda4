"""gRPC server reflection as both grpc.reflection.v1alpha and grpc.reflection.v1.

grpcio-reflection ships only v1alpha; v1 is the same protocol, messages and field numbers, under
another package name, so the same servicer answers it: `enable_reflection` registers v1alpha's
servicer under v1's method name too, after `_reflection_v1_descriptor` has put v1's file descriptor
(v1alpha's, renamed) in the default pool for reflection to describe. Call it once per server,
before it starts, with the full names of the services it serves.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _reflection_v1_descriptor() -> None:
    """v1's file descriptor (v1alpha's, renamed) in the default pool, so reflection can describe
    the v1 service too. Idempotent; a pool that has it already (a newer grpcio-reflection) is kept."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_REFLECTION_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = "." + fdp.package + ".", ".grpc.reflection.v1."
    fdp.name, fdp.package = _REFLECTION_V1_FILE, "grpc.reflection.v1"
    fdp.ClearField("options")
    messages = list(fdp.message_type)
    while messages:
        m = messages.pop()
        messages.extend(m.nested_type)
        for f in m.field:
            if f.HasField("type_name"):  # (assigning "" would mark a scalar field as typed)
                f.type_name = f.type_name.replace(old, new)
    for svc in fdp.service:
        for meth in svc.method:
            meth.input_type, meth.output_type = meth.input_type.replace(old, new), meth.output_type.replace(old, new)
    pool.AddSerializedFile(fdp.SerializeToString())


def enable_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Server reflection as grpc.reflection.v1alpha (grpcio-reflection's) and grpc.reflection.v1
    (the same servicer behind v1's method name: the wire format is identical)."""
    from grpc_reflection.v1alpha import reflection_pb2

    names = (*services, REFLECTION_V1, reflection.SERVICE_NAME)
    _reflection_v1_descriptor()
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1,
                                                                          {"ServerReflectionInfo": handler}),))
