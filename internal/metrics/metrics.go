package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// ReadyTimeout bounds a /readyz check: a readiness probe that waits longer
// than the kubelet's timeoutSeconds counts as a failure anyway.
const ReadyTimeout = 3 * time.Second

// NewRegistry returns a registry holding the Go runtime's and the
// process's collectors; each process (and each in-process test server)
// has its own.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Health is what /healthz and /readyz ask. A nil field answers 200.
type Health struct {
	// Live is nil while the process serves (liveness).
	Live func() error
	// Ready is nil when the process can do its work (readiness); it is
	// called with a context bounded by ReadyTimeout.
	Ready func(ctx context.Context) error
}

// Handler serves /metrics from reg (nil: no /metrics), /healthz and
// /readyz from h (see the package doc).
func Handler(reg *prometheus.Registry, h Health) http.Handler {
	mux := http.NewServeMux()
	if reg != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if h.Live != nil {
			if err := h.Live(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if h.Ready != nil {
			ctx, cancel := context.WithTimeout(r.Context(), ReadyTimeout)
			err := h.Ready(ctx)
			cancel()
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// Server is a running metrics and health listener.
type Server struct {
	lis  net.Listener
	srv  *http.Server
	done chan struct{}
}

// Serve serves handler on lis until Close; it owns lis.
func Serve(lis net.Listener, handler http.Handler, log *slog.Logger) *Server {
	s := &Server{lis: lis, srv: &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics and health endpoint stopped", "err", err)
		}
	}()
	log.Info("serving metrics and health", "address", lis.Addr().String())
	return s
}

// Listen binds addr and serves handler on it (see Serve).
func Listen(addr string, handler http.Handler, log *slog.Logger) (*Server, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen %s: %w", addr, err)
	}
	return Serve(lis, handler, log), nil
}

// Addr is the bound address.
func (s *Server) Addr() string { return s.lis.Addr().String() }

// Close stops serving, letting requests in flight finish for a few
// seconds, and waits for the serving goroutine.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	<-s.done
	return err
}
