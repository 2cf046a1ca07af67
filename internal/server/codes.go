package server

import (
	"context"
	"errors"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/raftstore"
)

// codeTable maps error classes to gRPC codes: the one place the control
// API chooses them. Order matters: the first match wins.
var codeTable = []struct {
	err  error
	code codes.Code
}{
	{ErrUnauthenticated, codes.Unauthenticated},
	{ErrPermissionDenied, codes.PermissionDenied},
	{ErrNoNodeIssuer, codes.FailedPrecondition},
	{pki.ErrIssuer, codes.FailedPrecondition},
	{pki.ErrCSR, codes.InvalidArgument},
	{ErrTokenReview, codes.Unavailable},
	{raftstore.ErrNotFound, codes.NotFound},
	{raftstore.ErrAlreadyExists, codes.AlreadyExists},
	{raftstore.ErrInvalidArgument, codes.InvalidArgument},
	{raftstore.ErrFailedPrecondition, codes.FailedPrecondition},
	{raftstore.ErrInsufficientServers, codes.ResourceExhausted},
	{raftstore.ErrInsufficientCapacity, codes.ResourceExhausted},
	{raftstore.ErrResourceExhausted, codes.ResourceExhausted},
	{raftstore.ErrStaleEpoch, codes.Aborted},
	{raftstore.ErrNotLeader, codes.Unavailable},
	{raftstore.ErrNoLeader, codes.Unavailable},
	{raftstore.ErrClosed, codes.Unavailable},
	{raftstore.ErrCorrupt, codes.DataLoss},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
}

// toStatus turns an error into a gRPC status error. Errors that already
// carry a status pass through; unknown errors are Internal.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	msg := strings.ReplaceAll(err.Error(), "raftstore: ", "")
	for _, e := range codeTable {
		if errors.Is(err, e.err) {
			return status.Error(e.code, msg)
		}
	}
	return status.Error(codes.Internal, msg)
}
