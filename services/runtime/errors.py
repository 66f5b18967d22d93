"""Errors a stage reports to its caller, each with the gRPC status it maps to."""

import grpc


class OmniError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(OmniError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(OmniError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(OmniError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(OmniError):
    code = grpc.StatusCode.UNAVAILABLE
