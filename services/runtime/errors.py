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


class NotFound(OmniError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(OmniError):
    code = grpc.StatusCode.UNAVAILABLE


class RequestFailed(Exception):
    """One request's own part of an engine step failed: that request fails alone and the step goes on without it."""

    def __init__(self, req, error: BaseException):
        super().__init__(str(error))
        self.req, self.error = req, error
