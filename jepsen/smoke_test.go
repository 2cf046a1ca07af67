package jepsen

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

func TestSmoke(t *testing.T) {
	requireHosts(t)
	dir := outDir(t, t.Name())
	self, _ := os.Executable()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := StartCluster(ctx, ClusterConfig{Servers: 3, Clients: 2, ServerBin: buildServer(t, t.TempDir()), SelfBin: self, Dir: filepath.Join(dir, "data")})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Control.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: c.Volume, SizeBytes: 64 << 20, ReplicaCount: 3}); err != nil {
		t.Fatal(err)
	}
	ep, err := c.Open(ctx, c.Clients[0])
	if err != nil {
		t.Fatal(err)
	}
	s, _ := c.Clients[0].Session()
	data := bytes.Repeat([]byte{7}, 4096)
	if r, err := s.Call(ctx, Request{Op: "write", Off: 4096, Data: data}); err != nil || !r.OK {
		t.Fatal(r, err)
	}
	r, err := s.Call(ctx, Request{Op: "read", Off: 4096, Len: 4096})
	if err != nil || !r.OK || !bytes.Equal(r.Data, data) {
		t.Fatal(r.Err, err)
	}
	t.Log("epoch", ep)
}
