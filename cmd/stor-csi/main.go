// Command stor-csi is stor's CSI driver (package csi): the controller
// beside the CSI sidecars, the node plugin in a DaemonSet, or both.
//
//	stor-csi --mode=controller --endpoint unix:///csi/csi.sock --servers stor-0.stor:7400,stor-1.stor:7400
//	stor-csi --mode=node --endpoint unix:///csi/csi.sock --servers ... --node-id $(NODE_NAME) --zone a --state-dir /var/lib/stor-csi
//
// --node-id, --zone, --state-dir and --max-volumes are the node's: the
// controller refuses them (they would do nothing there).
//
// Under TLS the node plugin's certificate must name its node
// (stor://csi-node/<node-id>). A DaemonSet cannot template that, so the
// node plugin can obtain its own from the cluster instead of --tls-cert:
//
//	stor-csi --mode=node --node-id $(NODE_NAME) --tls-ca /tls/ca.crt \
//	  --tls-bootstrap-cert /bootstrap/tls.crt --tls-bootstrap-key /bootstrap/tls.key \
//	  --token-file /var/run/secrets/stor/token --tls-dir /run/stor-tls ...
//
// It keeps and renews the certificate in --tls-dir (package nodecert).
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
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/nodecert"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/pvcevents"
	"github.com/stor-io/stor/replica/engine"
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
	fs.Func("local-socket", "node: short-circuit read socket of a stor-server on this node (its --local-socket); its replicas of a staged volume are read directly from its files (repeatable)", func(s string) error {
		cfg.LocalSockets = append(cfg.LocalSockets, s)
		return nil
	})
	fs.StringVar(&cfg.LocalSocketDir, "local-socket-dir", "", "node: a directory of stor-servers' short-circuit read sockets (*.sock), looked at on each attach (deploy/ shares /var/lib/stor-local with the servers)")
	fs.IntVar(&cfg.RebuildInFlight, "rebuild-in-flight", 0, fmt.Sprintf("node: chunks of 1 MiB a rebuild of a staged volume's replicas copies at once, 1 to %d (0: %d): fewer leave more of the disk and CPU to the volume's own I/O, more rebuild faster (docs/OPERATIONS.md)", engine.MaxRebuildInFlight, engine.DefaultRebuildInFlight))
	fs.Int64Var(&cfg.MaxVolumesPerNode, "max-volumes", 0, fmt.Sprintf("node: volumes this node may stage (the nbd module's device count); registered with the cluster, where the controller enforces it (default %d)", csi.DefaultMaxVolumesPerNode))
	fs.StringVar(&cfg.Version, "version", cfg.Version, "vendor version reported by GetPluginInfo")
	pvcEvents := fs.Bool("pvc-events", false, "controller: post stor's events about a claim's volume (faults, rebuilds, attaches) as Kubernetes Events on the claim; one controller posts, the holder of the Lease "+pvcevents.LeaseName)
	eventsNamespace := fs.String("pvc-events-namespace", "", "controller, with --pvc-events: the namespace of the Lease (deploy/ passes the pod's)")
	kubeconfig := fs.String("kubeconfig", "", "controller, with --pvc-events: kubeconfig of the Kubernetes API (default: in-cluster)")
	var files pki.Files
	fs.StringVar(&files.Cert, "tls-cert", "", "PEM certificate: stor://csi-controller/<name> (controller) or stor://csi-node/<node-id> (node); re-read when it changes")
	fs.StringVar(&files.Key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&files.CA, "tls-ca", "", "PEM CA bundle the servers' certificates must chain to")
	insecure := fs.Bool("insecure", false, "connect without TLS; every --servers address must then be on loopback")
	var boot bootstrapFlags
	fs.StringVar(&boot.cert, "tls-bootstrap-cert", "", "node: PEM bootstrap certificate (stor://"+string(pki.RoleCSINodeBootstrap)+"/<any>), used only to obtain this node's own certificate from the cluster into --tls-dir (instead of --tls-cert); re-read when it changes")
	fs.StringVar(&boot.key, "tls-bootstrap-key", "", "node: PEM key of --tls-bootstrap-cert")
	fs.StringVar(&boot.tokenFile, "token-file", "", "node, with --tls-bootstrap-cert: the pod's projected ServiceAccount token, audience \"stor\" (re-read at every renewal)")
	fs.StringVar(&boot.dir, "tls-dir", "", "node, with --tls-bootstrap-cert: directory (an emptyDir) that keeps the obtained certificate: "+nodecert.CertFile+", "+nodecert.KeyFile+", "+nodecert.CAFile)
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
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var renew *nodecert.Bootstrapper
	if boot.set() {
		b, closeBoot, err := boot.start(ctx, cfg, addrs, files, *insecure)
		if err != nil {
			return err
		}
		defer closeBoot()
		renew, files = b, b.Files()
	}
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
		cfg.Logger.Warn("--insecure: no TLS; the connections to the cluster are unauthenticated and unencrypted")
	default:
		return errNoCertificates
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
	if *pvcEvents {
		if cfg.Mode != csi.ModeController {
			return fmt.Errorf("--pvc-events is for --mode=controller")
		}
		mirror, err := pvcEventsConfig(*kubeconfig, *eventsNamespace, c, cfg.Logger)
		if err != nil {
			return fmt.Errorf("--pvc-events: %w", err)
		}
		mctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			if err := pvcevents.Run(mctx, mirror); err != nil {
				cfg.Logger.Error("mirroring stor events onto PVCs", "err", err)
			}
		}()
		defer func() { cancel(); <-done }()
	}
	if renew != nil {
		rctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			renew.Run(rctx) // returns when rctx ends
		}()
		defer func() { cancel(); wg.Wait() }()
	}
	return d.Run(ctx)
}

// bootstrapFlags are the node plugin's flags for obtaining its
// certificate from the cluster (package nodecert).
type bootstrapFlags struct {
	cert, key, tokenFile, dir string
}

func (b bootstrapFlags) set() bool {
	return b.cert != "" || b.key != "" || b.tokenFile != "" || b.dir != ""
}

// bootstrapTimeout bounds obtaining the first certificate at start.
const bootstrapTimeout = 5 * time.Minute

// start checks the flags, then makes --tls-dir hold a certificate for
// --node-id, obtained with the bootstrap certificate (files.CA is the
// servers' bundle). The returned func closes the bootstrap connection,
// which the Bootstrapper's renewals use.
func (b bootstrapFlags) start(ctx context.Context, cfg csi.Config, addrs []string, files pki.Files, insecure bool) (*nodecert.Bootstrapper, func(), error) {
	switch {
	case cfg.Mode != csi.ModeNode:
		return nil, nil, fmt.Errorf("--tls-bootstrap-cert, --token-file and --tls-dir are for --mode=node")
	case insecure:
		return nil, nil, fmt.Errorf("--insecure with --tls-bootstrap-cert")
	case files.Cert != "" || files.Key != "":
		return nil, nil, fmt.Errorf("--tls-bootstrap-cert replaces --tls-cert and --tls-key: the node's certificate is obtained into --tls-dir")
	case b.cert == "" || b.key == "" || b.tokenFile == "" || b.dir == "" || files.CA == "":
		return nil, nil, fmt.Errorf("a node certificate from the cluster needs --tls-bootstrap-cert, --tls-bootstrap-key, --token-file, --tls-dir and --tls-ca (have %q, %q, %q, %q, %q)", b.cert, b.key, b.tokenFile, b.dir, files.CA)
	}
	src, err := pki.Load(pki.Files{Cert: b.cert, Key: b.key, CA: files.CA}, cfg.Logger)
	if err != nil {
		return nil, nil, err
	}
	if id := src.Identity(); id.Role != pki.RoleCSINodeBootstrap {
		return nil, nil, fmt.Errorf("--tls-bootstrap-cert is %s; want a stor://%s/<any> certificate", id, pki.RoleCSINodeBootstrap)
	}
	c, err := client.Dial(addrs, src.GRPCDialCredentials())
	if err != nil {
		return nil, nil, err
	}
	bs, err := nodecert.New(nodecert.Config{NodeID: cfg.NodeID, Dir: b.dir, TokenFile: b.tokenFile, Issuer: c.Cluster, Logger: cfg.Logger})
	if err != nil {
		c.Close()
		return nil, nil, err
	}
	ectx, cancel := context.WithTimeout(ctx, bootstrapTimeout)
	defer cancel()
	if err := bs.Ensure(ectx); err != nil {
		c.Close()
		return nil, nil, err
	}
	return bs, func() { c.Close() }, nil
}

// checkRole refuses a certificate that is not the mode's: a controller is
// stor://csi-controller/<any>, a node stor://csi-node/<--node-id> (the
// cluster lets a node's certificate act only for the node it names); mode
// all would need both.
// errNoCertificates: stor-csi was given neither certificates nor --insecure.
var errNoCertificates = errors.New("no TLS certificates (--tls-cert, --tls-key and --tls-ca; cert-manager issues them in Kubernetes) and no --insecure (plaintext, loopback servers only)")

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

// pvcEventsConfig is the mirror's configuration: the Kubernetes API from
// kubeconfig (in-cluster when empty), the Lease in namespace, this pod's
// name (its host name) as the holder's identity.
func pvcEventsConfig(kubeconfig, namespace string, c *client.Client, logger *slog.Logger) (pvcevents.Config, error) {
	if namespace == "" {
		return pvcevents.Config{}, fmt.Errorf("--pvc-events-namespace is required")
	}
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return pvcevents.Config{}, err
	}
	core, err := corev1client.NewForConfig(rc)
	if err != nil {
		return pvcevents.Config{}, err
	}
	leases, err := coordinationv1client.NewForConfig(rc)
	if err != nil {
		return pvcevents.Config{}, err
	}
	host, err := os.Hostname()
	if err != nil {
		return pvcevents.Config{}, err
	}
	return pvcevents.Config{Events: c.Cluster, Core: core, Leases: leases, Namespace: namespace, Identity: host, Logger: logger}, nil
}
