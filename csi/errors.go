package csi

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/stor-io/stor/internal/attach"
)

// Errors of the driver itself. The table below gives each its CSI code.
var (
	// ErrInvalid: a request field is missing or malformed.
	ErrInvalid = errors.New("csi: invalid argument")
	// ErrNotFound: the named volume, snapshot or node does not exist.
	ErrNotFound = errors.New("csi: not found")
	// ErrAlreadyExists: the name or publication exists, incompatibly.
	ErrAlreadyExists = errors.New("csi: already exists")
	// ErrOutOfRange: the capacity cannot be satisfied within the range.
	ErrOutOfRange = errors.New("csi: out of range")
	// ErrPrecondition: the volume's state forbids the call (attached
	// elsewhere, not staged, ...).
	ErrPrecondition = errors.New("csi: failed precondition")
	// ErrBusy: another operation on the same volume is in progress.
	ErrBusy = errors.New("csi: operation in progress")
	// ErrNotReady: the driver has not finished starting (node recovery).
	ErrNotReady = errors.New("csi: not ready")
	// ErrTooMany: the node has as many volumes published as it may.
	ErrTooMany = errors.New("csi: too many volumes on the node")
	// ErrUnsupported: a capability this driver does not have.
	ErrUnsupported = errors.New("csi: unsupported")
	// ErrToken: a list call's starting_token is not one this driver gave
	// for that listing (list.go), or the cluster no longer takes the
	// position it holds.
	ErrToken = errors.New("csi: starting token not one this driver gave")
	// ErrClusterOrder: a cluster listing is not in id order, or repeats a
	// page token; the controller's paging relies on both (list.go).
	ErrClusterOrder = errors.New("csi: the cluster's listing is out of order")
)

// codeTable maps the driver's and its dependencies' errors to CSI codes,
// first match (errors.Is) wins. Errors that carry a gRPC status (the
// cluster's answers) keep their code unless listed here.
var codeTable = []struct {
	err  error
	code codes.Code
}{
	{ErrInvalid, codes.InvalidArgument},
	{ErrNotFound, codes.NotFound},
	{ErrAlreadyExists, codes.AlreadyExists},
	{ErrOutOfRange, codes.OutOfRange},
	{ErrPrecondition, codes.FailedPrecondition},
	{ErrBusy, codes.Aborted},
	{ErrNotReady, codes.Unavailable},
	{ErrTooMany, codes.ResourceExhausted},
	{ErrUnsupported, codes.InvalidArgument},
	{ErrToken, codes.Aborted},
	{ErrClusterOrder, codes.Internal},
	{attach.ErrAlreadyServed, codes.Aborted},
	{attach.ErrInUse, codes.FailedPrecondition},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
}

// toStatus turns err into the gRPC status error the CSI client sees.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err // already a status (only from the cluster, unwrapped)
	}
	for _, e := range codeTable {
		if errors.Is(err, e.err) {
			return status.Error(e.code, err.Error())
		}
	}
	var gs interface{ GRPCStatus() *status.Status }
	if errors.As(err, &gs) {
		if st := gs.GRPCStatus(); st != nil {
			return status.Error(st.Code(), err.Error())
		}
	}
	return status.Error(codes.Internal, err.Error())
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}

func notFoundf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrNotFound}, args...)...)
}

func preconditionf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrPrecondition}, args...)...)
}

// clusterCode is the gRPC code of a cluster call's error.
func clusterCode(err error) codes.Code {
	var gs interface{ GRPCStatus() *status.Status }
	if errors.As(err, &gs) {
		if st := gs.GRPCStatus(); st != nil {
			return st.Code()
		}
	}
	return codes.Unknown
}
