package ctl

import (
	"context"
	"strings"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/servertest"
)

func listCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// server drain --wait follows the leader's drain until the server holds
// no replica; server list then shows it draining, uncordon clears it.
func TestServerDrainWait(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 4-server cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{Servers: 4})
	c.Leader(10 * time.Second)
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	srv := []string{"--server", strings.Join(addrs, ",")}
	mustRun(t, append(srv, "volume", "create", "a", "--size", "4MiB", "--replicas", "3")...)
	mustRun(t, append(srv, "volume", "create", "b", "--size", "4MiB", "--replicas", "3")...)
	// The server holding the most replicas (at least one: 6 on 4 servers).
	held := map[string]int{}
	l, err := c.Dial().Volumes.ListVolumes(listCtx(t), &storpb.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	target := ""
	for _, v := range l.Volumes {
		for _, r := range v.Replicas {
			held[r.ServerId]++
			if held[r.ServerId] > held[target] {
				target = r.ServerId
			}
		}
	}
	out := mustRun(t, append(srv, "--timeout", "90s", "server", "drain", target, "--wait")...)
	if !strings.Contains(out, "server \""+target+"\" drained: it holds no replica") || !strings.Contains(out, "0 of ") {
		t.Fatalf("drain --wait output:\n%s", out)
	}
	l, err = c.Dial().Volumes.ListVolumes(listCtx(t), &storpb.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range l.Volumes {
		for _, r := range v.Replicas {
			if r.ServerId == target {
				t.Fatalf("volume %s still has replica %s on the drained server", v.Name, r.Id)
			}
		}
	}
	out = mustRun(t, append(srv, "server", "list")...)
	if row := rowStarting(t, out, target); row[3] != "up,draining" {
		t.Fatalf("server list row %q, want state up,draining", row)
	}
	mustRun(t, append(srv, "server", "uncordon", target)...)
	out = mustRun(t, append(srv, "server", "list")...)
	if row := rowStarting(t, out, target); row[3] != "up" {
		t.Fatalf("after uncordon: server list row %q, want state up", row)
	}
}
