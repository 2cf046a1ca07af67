package e2etest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/wire"
)

// TestReplicaServerSIGKILLDuringVerifiedWrites kills one replica's
// stor-server process with SIGKILL while a volume engine (in this test
// process) writes self-identifying blocks, restarts it, and checks that
// writes went on, every acknowledged write reads back, and the replica
// was rebuilt to be byte-identical to the others.
func TestReplicaServerSIGKILLDuringVerifiedWrites(t *testing.T) {
	c, st := startThree(t)
	all := c.addrs()
	var vol storpb.Volume
	mustCtlJSON(t, &vol, "--server", all, "volume", "create", "data", "--size", "64MiB", "--replicas", "3", "-o", "json")

	tlsSrc := operatorSource(t)
	dataDial := tlsSrc.Dialer(nil, pki.RoleServer)
	cl, err := client.Dial(strings.Split(all, ","), tlsSrc.GRPCDialCredentials())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := engine.Open(ctx, engine.Config{
		Volume: "data", NodeID: "e2e-client",
		Control:   engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster},
		Connect:   engine.WireConnector(wire.ClientConfig{Dial: dataDial}),
		IOTimeout: 3 * time.Second,
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background(), true)

	const blocks = 64 << 20 / 4096
	var (
		mu    sync.Mutex
		acked = map[int64]uint64{} // block -> seed of its last acknowledged write
		stop  = make(chan struct{})
		done  = make(chan int)
	)
	data := func(seed uint64) []byte {
		r := rand.New(rand.NewPCG(seed, seed))
		p := make([]byte, 4096)
		for i := range p {
			p[i] = byte(r.Uint32())
		}
		return p
	}
	go func() {
		n := 0
		defer func() { done <- n }()
		rng := rand.New(rand.NewPCG(42, 0))
		for i := uint64(1); ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			b := rng.Int64N(blocks)
			if err := e.WriteAt(ctx, data(i), b*4096, false); err != nil {
				t.Errorf("write %d: %v", i, err)
				return
			}
			mu.Lock()
			acked[b] = i
			mu.Unlock()
			n++
		}
	}()

	time.Sleep(500 * time.Millisecond)
	victim := c.servers[0]
	for _, s := range c.servers {
		if s.id != st.GetLeaderId() {
			victim = s
		}
	}
	t.Logf("killing %s with SIGKILL during writes", victim.id)
	victim.kill(t)
	time.Sleep(2 * time.Second)
	mu.Lock()
	during := len(acked)
	mu.Unlock()
	victim.start(t)
	time.Sleep(time.Second)
	close(stop)
	if n := <-done; n == 0 {
		t.Fatal("no write acknowledged")
	}
	mu.Lock()
	after := len(acked)
	mu.Unlock()
	if after <= during {
		t.Fatalf("writes did not continue after the kill (%d blocks before the restart, %d after)", during, after)
	}
	if err := e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	for b, seed := range acked {
		if err := e.ReadAt(ctx, got, b*4096); err != nil || !bytes.Equal(got, data(seed)) {
			t.Fatalf("block %d lost its acknowledged write (%v)", b, err)
		}
	}
	c.eventually(t, 60*time.Second, "every replica healthy and identical", func() error {
		resp, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: vol.Id}})
		if err != nil {
			return err
		}
		for _, r := range resp.Volume.Replicas {
			if r.State != storpb.ReplicaState_REPLICA_STATE_HEALTHY {
				return fmt.Errorf("replica %s on %s is %v", r.Id, r.ServerId, r.State)
			}
		}
		sums, err := servertest.ChecksumsWith(ctx, cl, vol.Id, dataDial)
		if err != nil {
			return err
		}
		for _, d := range sums {
			if d.Err != nil || d.SHA256 != sums[0].SHA256 {
				return fmt.Errorf("replica %s: %s (%v), first %s", d.Replica.Id, d.SHA256, d.Err, sums[0].SHA256)
			}
		}
		return nil
	})
	t.Logf("%d blocks hold acknowledged writes (%d before %s restarted); replicas identical", len(acked), during, victim.id)
}
