// Package ctl is stor-ctl, the operator's command line for a stor cluster: a
// cobra command tree over the control API (internal/client).
//
// The tree is built per invocation by NewRootCommand and holds no global
// state, so tests run it in-process against fake servers. Execute runs one
// invocation and turns its error into a single line on stderr and an exit
// code:
//
//	0  success
//	1  the call failed (the server's status message, or the cluster was
//	   unavailable until --timeout)
//	2  the command line is wrong (unknown command or flag, bad argument)
//
// Read commands print human tables (text/tabwriter) by default and protojson
// with -o json: the object itself for single objects (a Volume, a Snapshot,
// the StatusResponse), the response message for lists (ListVolumesResponse
// holding every page).
package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/pki"
)

// Defaults of the global flags.
const (
	defaultServer  = "127.0.0.1:7400"
	defaultTimeout = 10 * time.Second
	serverEnv      = "STOR_SERVER"
)

// Output formats accepted by --output.
const (
	outputTable = "table"
	outputJSON  = "json"
)

// app is one invocation's state: where output goes and the global flags.
type app struct {
	stdout, stderr io.Writer
	// now is the clock for ages ("2s ago"); time.Now outside tests.
	now func() time.Time

	server    string
	timeout   time.Duration
	output    string
	logFormat string // --log-format of the commands that log (nbd serve, nbd attach)

	tls      pki.Files // --tls-cert, --tls-key, --tls-ca; see tlsFiles
	insecure bool
	// dataDial opens connections to the servers' data ports (nbd serve):
	// set by dial, under TLS when the control connection is.
	dataDial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// usageError marks an error in the command line itself (exit code 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usageErrorf(format string, args ...any) error {
	return usageError{fmt.Errorf(format, args...)}
}

// NewRootCommand returns the stor-ctl command tree writing to stdout and
// stderr. The caller sets its arguments and executes it; Execute does both.
func NewRootCommand(stdout, stderr io.Writer) *cobra.Command {
	return newRootCommand(&app{stdout: escapingWriter{stdout}, stderr: escapingWriter{stderr}, now: time.Now})
}

// Execute runs stor-ctl with args (without the program name) and returns the
// process exit code. Errors are printed to stderr as one line.
func Execute(args []string, stdout, stderr io.Writer) int {
	return execute(&app{stdout: stdout, stderr: stderr, now: time.Now}, args)
}

func execute(a *app, args []string) int {
	return executeContext(context.Background(), a, args)
}

// executeContext is execute with a context for the commands (nbd serve
// stops when it ends, as on SIGINT).
func executeContext(ctx context.Context, a *app, args []string) int {
	a.stdout, a.stderr = escapingWriter{a.stdout}, escapingWriter{a.stderr}
	root := newRootCommand(a)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	fmt.Fprintf(a.stderr, "stor-ctl: %s\n", escape(oneLine(err.Error())))
	var ue usageError
	if errors.As(err, &ue) {
		return 2
	}
	return 1
}

// oneLine folds a multi-line message so an error is always one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

func newRootCommand(a *app) *cobra.Command {
	root := &cobra.Command{
		Use:   "stor-ctl",
		Short: "Operate a stor block storage cluster",
		Long: `stor-ctl operates a stor cluster through its control API: cluster status,
servers, volumes and snapshots; "nbd serve" serves a volume over NBD.

Any server of the cluster answers any command. Give several with
--server a:7400,b:7400 (or $` + serverEnv + `) and stor-ctl uses the first that
answers; while the cluster has no leader it retries until --timeout.
Connections use mutual TLS with the certificate of --tls-cert (or
$STOR_CERT, or make cluster's in $STOR_DATA/tls); without one they are
plaintext, and --insecure allows only loopback servers.

Exit status: 0 on success, 1 when the call failed, 2 for a bad command line.`,
		SilenceErrors: true,
		SilenceUsage:  true,
		Args:          unknownSubcommand,
		RunE:          func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
		PersistentPreRunE: func(*cobra.Command, []string) error {
			if a.output != outputTable && a.output != outputJSON {
				return usageErrorf("invalid --output %q: want %s or %s", a.output, outputTable, outputJSON)
			}
			if a.timeout <= 0 {
				return usageErrorf("invalid --timeout %v: must be positive", a.timeout)
			}
			if _, err := logging.New(io.Discard, a.logFormat, "info"); err != nil {
				return usageError{err}
			}
			return nil
		},
	}
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })

	pf := root.PersistentFlags()
	pf.StringVar(&a.server, "server", defaultServer,
		"control address(es) of the cluster, comma-separated; $"+serverEnv+" when the flag is not given")
	pf.DurationVar(&a.timeout, "timeout", defaultTimeout, "time limit for the whole command, retries included")
	pf.StringVarP(&a.output, "output", "o", outputTable, "output format: table or json")
	pf.StringVar(&a.logFormat, "log-format", logging.FormatText, "format of the log lines nbd serve and nbd attach write to stderr: text (key=value) or json (one JSON object per line)")
	pf.StringVar(&a.tls.Cert, "tls-cert", "", "PEM operator certificate (stor://operator/<name>); $"+certEnv+" when not given, else make cluster's in $"+dataEnv+"/tls")
	pf.StringVar(&a.tls.Key, "tls-key", "", "PEM key of --tls-cert; $"+keyEnv+" when not given")
	pf.StringVar(&a.tls.CA, "tls-ca", "", "PEM CA bundle the servers' certificates must chain to; $"+caEnv+" when not given")
	pf.BoolVar(&a.insecure, "insecure", false, "connect without TLS; every --server address must then be on loopback")

	root.AddCommand(
		newClusterCommand(a),
		newServerCommand(a),
		newNodeCommand(a),
		newVolumeCommand(a),
		newReplicaCommand(a),
		newSnapshotCommand(a),
		newEventsCommand(a),
		newNBDCommand(a),
		newCertsCommand(a),
	)
	return root
}

// group returns a command that only holds subcommands.
func group(use, short string, subs ...*cobra.Command) *cobra.Command {
	c := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  unknownSubcommand,
		RunE:  func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	c.AddCommand(subs...)
	return c
}

// unknownSubcommand rejects arguments to a command that only groups others.
func unknownSubcommand(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	hint := ""
	cmd.SuggestionsMinimumDistance = 2
	if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
		hint = fmt.Sprintf(" (did you mean %s?)", strings.Join(quoteAll(s), " or "))
	}
	return usageErrorf("unknown command %q for %q%s", args[0], cmd.CommandPath(), hint)
}

func quoteAll(ss []string) []string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = strconv.Quote(s)
	}
	return q
}

// commandName is the command's path without the program name, as errors
// name it after the "stor-ctl: " prefix: "volume get".
func commandName(cmd *cobra.Command) string {
	if !cmd.HasParent() {
		return cmd.Name()
	}
	return strings.TrimPrefix(cmd.CommandPath(), cmd.Root().Name()+" ")
}

// exactArgs requires exactly the named positional arguments.
func exactArgs(names ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		switch {
		case len(names) == 0 && len(args) > 0:
			return usageErrorf("%s expects no arguments, got %q", commandName(cmd), args)
		case len(args) != len(names):
			return usageErrorf("%s expects %s, got %d argument(s)", commandName(cmd), strings.Join(names, " "), len(args))
		}
		for i, arg := range args {
			if strings.TrimSpace(arg) == "" {
				return usageErrorf("%s: %s must not be empty", commandName(cmd), names[i])
			}
		}
		return nil
	}
}

// serverAddrs returns the control addresses to dial: --server if given, else
// $STOR_SERVER if set, else the default.
func (a *app) serverAddrs(cmd *cobra.Command) ([]string, error) {
	spec := a.server
	if !cmd.Flags().Changed("server") {
		if env := strings.TrimSpace(os.Getenv(serverEnv)); env != "" {
			spec = env
		}
	}
	var addrs []string
	for _, s := range strings.Split(spec, ",") {
		if s = strings.TrimSpace(s); s != "" {
			addrs = append(addrs, s)
		}
	}
	if len(addrs) == 0 {
		return nil, usageErrorf("invalid --server %q: no address", spec)
	}
	return addrs, nil
}

// call dials the cluster, runs fn under --timeout and turns a gRPC error into
// the message stor-ctl prints.
func (a *app) call(cmd *cobra.Command, fn func(ctx context.Context, c *client.Client) error) error {
	c, addrs, err := a.dial(cmd)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(cmd.Context(), a.timeout)
	defer cancel()
	if err := fn(ctx, c); err != nil {
		return a.describe(err, addrs)
	}
	return nil
}

// describe turns an error from a call into the line the operator reads: the
// server's status message, without the gRPC code unless the message is empty.
func (a *app) describe(err error, addrs []string) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	at := strings.Join(addrs, ",")
	msg := st.Message()
	switch st.Code() {
	case codes.Unavailable:
		if msg == "" {
			return fmt.Errorf("cluster unavailable at %s", at)
		}
		return fmt.Errorf("cluster unavailable at %s: %s", at, msg)
	case codes.DeadlineExceeded:
		if msg == "" || msg == context.DeadlineExceeded.Error() {
			return fmt.Errorf("no answer from the cluster at %s within %v", at, a.timeout)
		}
		return fmt.Errorf("no answer from the cluster at %s within %v: %s", at, a.timeout, msg)
	}
	if msg == "" {
		msg = st.Code().String()
	}
	return errors.New(msg)
}

// dial connects to the servers the command names (--servers or the
// default) and returns their addresses for describe; the caller closes
// the client.
func (a *app) dial(cmd *cobra.Command) (*client.Client, []string, error) {
	addrs, err := a.serverAddrs(cmd)
	if err != nil {
		return nil, nil, err
	}
	opts, dataDial, err := a.transport(cmd, addrs)
	if err != nil {
		return nil, nil, err
	}
	a.dataDial = dataDial
	c, err := client.Dial(addrs, opts...)
	return c, addrs, err
}
