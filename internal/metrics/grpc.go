package metrics

import (
	"context"
	"path"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// RPCs counts a gRPC server's calls by method and code and observes their
// latency: stor_<subsystem>_rpcs_total{method,code} and
// stor_<subsystem>_rpc_duration_seconds{method}. The method label is the
// method's short name (CreateVolume), a set fixed by the services.
type RPCs struct {
	calls    *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// NewRPCs returns the collector for a gRPC server; subsystem is "csi" or
// "api". Register it, and install Unary (and Stream) as interceptors.
func NewRPCs(subsystem string) *RPCs {
	return &RPCs{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "stor", Subsystem: subsystem, Name: "rpcs_total",
			Help: "gRPC calls handled, by method and status code.",
		}, []string{"method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "stor", Subsystem: subsystem, Name: "rpc_duration_seconds",
			Help:    "gRPC call latency, by method.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9), // 1 ms .. 65 s
		}, []string{"method"}),
	}
}

// Describe implements prometheus.Collector.
func (m *RPCs) Describe(ch chan<- *prometheus.Desc) { m.calls.Describe(ch); m.duration.Describe(ch) }

// Collect implements prometheus.Collector.
func (m *RPCs) Collect(ch chan<- prometheus.Metric) { m.calls.Collect(ch); m.duration.Collect(ch) }

func (m *RPCs) observe(fullMethod string, start time.Time, err error) {
	method := path.Base(fullMethod)
	m.calls.WithLabelValues(method, status.Code(err).String()).Inc()
	m.duration.WithLabelValues(method).Observe(time.Since(start).Seconds())
}

// Unary is the unary server interceptor.
func (m *RPCs) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	m.observe(info.FullMethod, start, err)
	return resp, err
}

// Stream is the stream server interceptor (a stream counts once, when it
// ends).
func (m *RPCs) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	start := time.Now()
	err := handler(srv, ss)
	m.observe(info.FullMethod, start, err)
	return err
}
