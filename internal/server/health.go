package server

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// Health service names answered on the control port by the standard gRPC
// health protocol (grpc.health.v1.Health/Check), which Kubernetes probes
// natively (a probe's grpc.service field):
//
//   - "" (readiness): SERVING while this server is a cluster member that
//     knows the current Raft leader, so calls it receives can be answered or
//     forwarded. A server that has not joined yet, one the cluster refuses
//     for its data dir, or one cut off from the majority long enough to
//     lose its leader, is NOT_SERVING.
//   - "liveness": SERVING whenever the process answers at all. Restarting a
//     server because it lost its leader would not help it find one.
const (
	HealthReadiness = ""
	HealthLiveness  = "liveness"
)

// healthService computes each answer from the server's state at the time
// of the call rather than from a status someone has to remember to set.
type healthService struct {
	healthpb.UnimplementedHealthServer
	s *Server
}

func (h *healthService) Check(ctx context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	switch req.GetService() {
	case HealthLiveness:
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
	case HealthReadiness:
		st := healthpb.HealthCheckResponse_NOT_SERVING
		if h.s.ready() {
			st = healthpb.HealthCheckResponse_SERVING
		}
		return &healthpb.HealthCheckResponse{Status: st}, nil
	default:
		return nil, status.Errorf(codes.NotFound, "unknown health service %q (use %q or %q)", req.GetService(), HealthReadiness, HealthLiveness)
	}
}

// ready reports whether this server is a member that knows its leader
// (notReady says why not).
func (s *Server) ready() bool { return s.notReady() == nil }

// notReady says why this server is not ready, or nil. One that has not
// joined yet is not, nor one whose reports the leader refuses for its
// data dir (raftstore.ErrDataDirReplaced): either may still hear from the
// leader, being in the Raft configuration.
func (s *Server) notReady() error {
	switch {
	case s.ctx.Err() != nil:
		return errors.New("server: not ready: stopping")
	case s.dirRefused.Load():
		return errors.New("server: not ready: the cluster refuses this server's data dir (see its log)")
	case !s.store.Member():
		return errors.New("server: not ready: not joined yet")
	case s.removed.Load():
		return errors.New("server: not ready: removed from the cluster (see its log)")
	}
	if id, _ := s.store.Leader(); id == "" {
		return errNotReady
	}
	return nil
}
