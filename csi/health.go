package csi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/metrics"
)

// ReadyTimeout bounds Ready's cluster call: a readiness probe that waits
// longer than the kubelet's timeoutSeconds counts as a failure anyway.
const ReadyTimeout = 3 * time.Second

// Ready reports whether the driver can do its work, nil when it can:
//
//   - controller (and all) mode: the cluster answers Status and has a
//     leader, so Create/Delete/Publish can commit;
//   - node (and all) mode: the node registered itself with the cluster and
//     recovery of its staged volumes has run.
//
// It is what /readyz answers; Probe does not depend on it (see Probe).
func (d *Driver) Ready(ctx context.Context) error {
	if d.cfg.Mode.controller() {
		cctx, cancel := context.WithTimeout(ctx, min(d.cfg.CallTimeout, ReadyTimeout))
		st, err := d.cfg.Cluster.Cluster.Status(cctx, &storpb.StatusRequest{})
		cancel()
		switch {
		case err != nil:
			return fmt.Errorf("%w: the cluster does not answer: %v", ErrNotReady, err)
		case st.GetLeaderId() == "":
			return fmt.Errorf("%w: the cluster has no leader", ErrNotReady)
		}
	}
	if d.node != nil {
		switch {
		case !d.node.recovered.Load():
			return fmt.Errorf("%w: recovering the staged volumes", ErrNotReady)
		case !d.node.registered.Load():
			return fmt.Errorf("%w: node %q is not registered with the cluster", ErrNotReady, d.cfg.NodeID)
		}
	}
	return nil
}

// Health is the HTTP handler Run serves on Config.HealthListen
// (metrics.Handler):
//
//	/metrics  the driver's series: CSI calls by method and code with their
//	          latency, and (node) each served volume's I/O;
//	/healthz  200 while the process runs and its CSI gRPC server serves
//	          (liveness; never consults the cluster);
//	/readyz   200 when Ready is nil, 503 with the reason otherwise
//	          (readiness, and the node plugin's startupProbe: the budget
//	          recovery gets before the kubelet restarts it).
func (d *Driver) Health() http.Handler {
	return metrics.Handler(d.registry, metrics.Health{
		Live: func() error {
			if !d.serving.Load() {
				return errors.New("the CSI endpoint is not served")
			}
			return nil
		},
		Ready: d.Ready,
	})
}

// serveHealth serves Health on Config.HealthListen until stop is called; a
// listen error is returned at once.
func (d *Driver) serveHealth() (stop func(), err error) {
	lis, err := listenTCP(d.cfg.HealthListen)
	if err != nil {
		return nil, fmt.Errorf("csi: health listener: %w", err)
	}
	srv := &http.Server{Handler: d.Health(), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			d.log.Error("health endpoint stopped", "err", err)
		}
	}()
	d.log.Info("serving health", "address", lis.Addr().String())
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		<-done
	}, nil
}
