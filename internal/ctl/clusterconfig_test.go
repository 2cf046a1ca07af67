package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// TestClusterConfigRoundTrip: stor-ctl sets the cluster config on a real
// cluster, reads it back, and server list counts provisionable bytes with
// the ratio set.
func TestClusterConfigRoundTrip(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, Configure: func(i int, cfg *server.Config) {
		cfg.Capacity = 4 << 30
	}})
	c.Leader(10 * time.Second)
	srv := []string{"--server", c.Nodes[0].Addr}

	out := mustRun(t, append(srv, "cluster", "config", "get")...)
	assertCells(t, out, "REPLACE AFTER:", "server default (stor-server --replace-after)")
	assertCells(t, out, "OVER-PROVISIONING:", "100% (default)")

	out = mustRun(t, append(srv, "cluster", "config", "set", "--replace-after", "2m", "--over-provisioning", "300")...)
	assertCells(t, out, "REPLACE AFTER:", "2m0s")
	assertCells(t, out, "OVER-PROVISIONING:", "300%")
	mustRun(t, append(srv, "cluster", "config", "set", "--replace-after", "90s")...)
	out = mustRun(t, append(srv, "cluster", "config", "get")...)
	assertCells(t, out, "REPLACE AFTER:", "1m30s")
	assertCells(t, out, "OVER-PROVISIONING:", "300%")
	out = mustRun(t, append(srv, "-o", "json", "cluster", "config", "get")...)
	var js struct {
		ReplaceAfterSeconds     string `json:"replaceAfterSeconds"`
		OverProvisioningPercent int    `json:"overProvisioningPercent"`
	}
	if err := json.Unmarshal([]byte(out), &js); err != nil || js.ReplaceAfterSeconds != "90" || js.OverProvisioningPercent != 300 {
		t.Fatalf("json config %+v (%v):\n%s", js, err, out)
	}

	out = mustRun(t, append(srv, "server", "list")...)
	row := rowStarting(t, out, c.Nodes[0].ID)
	if got, want := strings.Join(row[:min(len(row), 7)], "|"), strings.Join([]string{c.Nodes[0].ID, c.Nodes[0].Addr, "-", "up", "4 GiB", "0 B", "12 GiB"}, "|"); got != want {
		t.Fatalf("server list row %q, want it to start %q (the last seen time follows)\n%s", got, want, out)
	}
	// USED: what the server's heartbeats report of its data disk (the
	// test's temp dir is on a real filesystem: some bytes are in use).
	if len(row) < 9 || row[7] == "-" {
		t.Fatalf("server list row %q: want the data disk's used bytes in USED\n%s", row, out)
	}

	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--over-provisioning", "50"}, 1, "over-provisioning 50% is outside 100..10000%"},
		{[]string{"--replace-after", "10s"}, 1, "replace-after 10s is outside 30s..168h0m0s"},
		{[]string{"--replace-after", "1500ms"}, 2, "want a positive whole number of seconds"},
		{nil, 2, "give --replace-after or --over-provisioning"},
	} {
		r := run(t, append(append(srv, "cluster", "config", "set"), tc.args...)...)
		if r.code != tc.code || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("config set %v: exit %d, stderr %q; want exit %d containing %q", tc.args, r.code, r.stderr, tc.code, tc.want)
		}
	}
	out = mustRun(t, append(srv, "cluster", "config", "get")...)
	assertCells(t, out, "OVER-PROVISIONING:", "300%")
}

// TestServerCordonRoundTrip: stor-ctl cordons the only server of a real
// cluster, a volume is then refused, and placed again after uncordon.
func TestServerCordonRoundTrip(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Servers: 1})
	c.Leader(10 * time.Second)
	srv := []string{"--server", c.Nodes[0].Addr}
	id := c.Nodes[0].ID
	create := func(name string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := c.Client(0).Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: 1 << 20, ReplicaCount: 1})
		return err
	}

	if out := mustRun(t, append(srv, "server", "cordon", id)...); out != fmt.Sprintf("server %q cordoned\n", id) {
		t.Fatalf("cordon printed %q", out)
	}
	if row := rowStarting(t, mustRun(t, append(srv, "server", "list")...), id); len(row) < 4 || row[3] != "up,cordoned" {
		t.Fatalf("server list row %q: want state up,cordoned", row)
	}
	if err := create("refused"); status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "1 cordoned") {
		t.Fatalf("volume on the cordoned only server: %v, want ResourceExhausted counting 1 cordoned", err)
	}
	mustRun(t, append(srv, "server", "uncordon", id)...)
	if row := rowStarting(t, mustRun(t, append(srv, "server", "list")...), id); len(row) < 4 || row[3] != "up" {
		t.Fatalf("server list row %q: want state up", row)
	}
	if err := create("placed"); err != nil {
		t.Fatalf("volume after uncordon: %v", err)
	}
	if r := run(t, append(srv, "server", "cordon", "nosuch")...); r.code != 1 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("cordon of an unknown server: exit %d, stderr %q; want exit 1, not found", r.code, r.stderr)
	}
}
