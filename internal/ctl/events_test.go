package ctl

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stor-io/stor/internal/servertest"
)

// events lists what the cluster did, --volume one volume's, --follow new
// ones as they happen; volume describe ends with the volume's.
func TestEventsAndDescribe(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster; skipped with -short")
	}
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	c.Leader(10 * time.Second)
	srv := []string{"--server", c.Nodes[0].Addr}
	mustRun(t, append(srv, "volume", "create", "db", "--size", "8MiB", "--replicas", "3")...)
	mustRun(t, append(srv, "volume", "create", "other", "--size", "8MiB", "--replicas", "1")...)

	out := mustRun(t, append(srv, "events")...)
	for _, want := range []string{"ServerRegistered", "server/s1", "VolumeCreated", "volume/db", "volume/other"} {
		if !strings.Contains(out, want) {
			t.Fatalf("events lacks %q:\n%s", want, out)
		}
	}
	out = mustRun(t, append(srv, "events", "--volume", "db")...)
	if !strings.Contains(out, "volume db created") || strings.Contains(out, "volume/other") || strings.Contains(out, "server/") {
		t.Fatalf("events --volume db:\n%s", out)
	}

	// --follow prints an expansion made while it runs.
	done := make(chan result, 1)
	go func() { done <- run(t, append(srv, "--timeout", "8s", "events", "--volume", "db", "--follow")...) }()
	time.Sleep(1500 * time.Millisecond)
	mustRun(t, append(srv, "volume", "expand", "db", "--size", "16MiB")...)
	r := <-done
	if r.code != 0 || !strings.Contains(r.stdout, "VolumeExpanded") || !strings.Contains(r.stdout, "expanded from 8388608 to 16777216 bytes") {
		t.Fatalf("events --follow: exit %d, stderr %q, stdout:\n%s", r.code, r.stderr, r.stdout)
	}

	mustRun(t, append(srv, "snapshot", "create", "db", "before")...)
	out = mustRun(t, append(srv, "volume", "describe", "db")...)
	for _, want := range []string{"NAME:", "REPLICA", "Snapshots:", "before", "Events:", "VolumeCreated", "VolumeExpanded"} {
		if !strings.Contains(out, want) {
			t.Fatalf("volume describe lacks %q:\n%s", want, out)
		}
	}
	out = mustRun(t, append(srv, "-o", "json", "volume", "describe", "db")...)
	var d struct {
		Volume    map[string]any   `json:"volume"`
		Snapshots []map[string]any `json:"snapshots"`
		Events    []map[string]any `json:"events"`
	}
	if err := json.Unmarshal([]byte(out), &d); err != nil {
		t.Fatalf("volume describe -o json: %v\n%s", err, out)
	}
	if d.Volume["name"] != "db" || len(d.Snapshots) != 1 || len(d.Events) < 2 {
		t.Fatalf("volume describe -o json: %+v", d)
	}
}
