// Command stor-csi is stor's CSI driver (package csi): the controller
// beside the CSI sidecars, the node plugin in a DaemonSet, or both.
//
//	stor-csi --mode=controller --endpoint unix:///csi/csi.sock --servers stor-0.stor:7400,stor-1.stor:7400
//	stor-csi --mode=node --endpoint unix:///csi/csi.sock --servers ... --node-id $(NODE_NAME) --zone a --state-dir /var/lib/stor-csi
//
// --node-id, --zone, --state-dir and --max-volumes are the node's: the
// controller refuses them (they would do nothing there).
//
// The node id is the Kubernetes node name; the node plugin registers it
// with the cluster, then resumes every volume it had staged (recorded in
// --state-dir), before Probe reports ready; on SIGTERM it stops serving
// without detaching, so the next start resumes the devices.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"google.golang.org/grpc"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/pki"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "stor-csi: %v\n", err)
		os.Exit(1)
	}
}

// run runs the binary with args until ctx ends; logs go to stderr.
func run(ctx context.Context, args []string, stderr io.Writer) error {
	cfg := csi.DefaultConfig()
	fs := flag.NewFlagSet("stor-csi", flag.ContinueOnError)
	mode := fs.String("mode", "all", "controller, node or all")
	fs.StringVar(&cfg.Endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint (a unix socket)")
	fs.StringVar(&cfg.HealthListen, "health-listen", "", "host:port for plain HTTP /metrics (Prometheus), /healthz (liveness: the process serves CSI) and /readyz (controller: the cluster has a leader; node: registered and staged volumes recovered); empty: none")
	fs.StringVar(&cfg.HealthListen, "metrics-listen", "", "the same listener as --health-listen (either name; the last given wins)")
	servers := fs.String("servers", "127.0.0.1:7400", "comma-separated stor-server control addresses")
	fs.StringVar(&cfg.NodeID, "node-id", "", "this node's id, the Kubernetes node name; registered with the cluster at start (node mode; default: the host name)")
	fs.StringVar(&cfg.DriverName, "driver-name", cfg.DriverName, "CSI driver name (and topology key suffix)")
	fs.StringVar(&cfg.StateDir, "state-dir", "", "node: where staged volumes are recorded, for restart recovery (default "+csi.DefaultStateDir+")")
	fs.StringVar(&cfg.Zone, "zone", "", "node: this node's zone (topology segment topology.<driver-name>/zone)")
	fs.Int64Var(&cfg.MaxVolumesPerNode, "max-volumes", 0, fmt.Sprintf("node: volumes this node may stage (the nbd module's device count); registered with the cluster, where the controller enforces it (default %d)", csi.DefaultMaxVolumesPerNode))
	fs.StringVar(&cfg.Version, "version", cfg.Version, "vendor version reported by GetPluginInfo")
	var files pki.Files
	fs.StringVar(&files.Cert, "tls-cert", "", "PEM certificate: stor://csi-controller/<name> (controller) or stor://csi-node/<node-id> (node); re-read when it changes")
	fs.StringVar(&files.Key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&files.CA, "tls-ca", "", "PEM CA bundle the servers' certificates must chain to")
	insecure := fs.Bool("insecure", false, "connect without TLS; every --servers address must then be on loopback")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	logFormat := fs.String("log-format", logging.FormatText, logging.FormatUsage)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if cfg.Logger, err = logging.New(stderr, *logFormat, *logLevel); err != nil {
		return err
	}
	cfg.Mode = csi.Mode(*mode)
	if cfg.NodeID == "" && cfg.Mode != csi.ModeController {
		host, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("no --node-id and no host name: %w", err)
		}
		cfg.NodeID = host
	}
	addrs := strings.Split(*servers, ",")
	var opts []grpc.DialOption
	switch {
	case files.Set() && *insecure:
		return fmt.Errorf("--insecure with --tls-cert")
	case files.Set():
		src, err := pki.Load(files, cfg.Logger)
		if err != nil {
			return err
		}
		if err := checkRole(src.Identity(), cfg.Mode, cfg.NodeID); err != nil {
			return err
		}
		opts = append(opts, src.GRPCDialCredentials())
		cfg.DataDial = src.Dialer(nil, pki.RoleServer)
	case *insecure:
		if err := pki.CheckLoopback(addrs...); err != nil {
			return err
		}
	default:
		cfg.Logger.Warn("no TLS: the connections to the cluster are unauthenticated and unencrypted")
	}
	c, err := client.Dial(addrs, opts...)
	if err != nil {
		return err
	}
	defer c.Close()
	cfg.Cluster = csi.Cluster{Cluster: c.Cluster, Volumes: c.Volumes, Snapshots: c.Snapshots}
	d, err := csi.New(cfg)
	if err != nil {
		return err
	}
	return d.Run(ctx)
}

// checkRole refuses a certificate that is not the mode's: a controller is
// stor://csi-controller/<any>, a node stor://csi-node/<--node-id> (the
// cluster lets a node's certificate act only for the node it names); mode
// all would need both.
func checkRole(id pki.Identity, mode csi.Mode, nodeID string) error {
	switch {
	case mode == csi.ModeController && id.Role != pki.RoleCSIController:
		return fmt.Errorf("--tls-cert is %s; the controller needs a %s certificate", id, pki.RoleCSIController)
	case mode == csi.ModeNode && id != (pki.Identity{Role: pki.RoleCSINode, Name: nodeID}):
		return fmt.Errorf("--tls-cert is %s; node %q needs stor://%s/%s", id, nodeID, pki.RoleCSINode, nodeID)
	case mode != csi.ModeController && mode != csi.ModeNode:
		return fmt.Errorf("--mode=%s cannot run with TLS: the controller and the node plugin need different certificates (%s and %s); run them as two processes", mode, pki.RoleCSIController, pki.RoleCSINode)
	}
	return nil
}
