package server_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
)

// percentile returns the p-th percentile (0..100) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1) * p / 100)
	return sorted[i]
}

func reportLatencies(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	b.ReportMetric(float64(percentile(lat, 50).Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(percentile(lat, 99).Microseconds())/1000, "p99-ms")
}

// BenchmarkCreateVolume measures CreateVolume on a 3-server loopback
// cluster with fsync on (the Raft log and the state machine both sync
// every commit), one caller at a time, through a follower (so each call is
// forwarded to the leader, the common path for clients that do not know
// the leader).
func BenchmarkCreateVolume(b *testing.B) {
	c := servertest.NewCluster(b, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	cl := c.Client((leader + 1) % 3)
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		start := time.Now()
		_, err := cl.Volumes.CreateVolume(context.Background(), &storpb.CreateVolumeRequest{
			Name: fmt.Sprintf("bench-%d", i), SizeBytes: 1 << 30, ReplicaCount: 3,
		})
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	reportLatencies(b, lat)
}

// BenchmarkCreateVolumeParallel measures throughput with 16 concurrent
// callers; Raft batches their entries into shared fsyncs.
func BenchmarkCreateVolumeParallel(b *testing.B) {
	c := servertest.NewCluster(b, servertest.Options{})
	leader := c.Leader(10 * time.Second)
	cl := c.Client(leader)
	var (
		mu  sync.Mutex
		lat = make([]time.Duration, 0, b.N)
		seq atomic.Int64
	)
	b.SetParallelism(8) // 8 x GOMAXPROCS(2) = 16 callers
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			t0 := time.Now()
			_, err := cl.Volumes.CreateVolume(context.Background(), &storpb.CreateVolumeRequest{
				Name: fmt.Sprintf("bench-%d", seq.Add(1)), SizeBytes: 1 << 30, ReplicaCount: 3,
			})
			if err != nil {
				b.Error(err)
				return
			}
			mu.Lock()
			lat = append(lat, time.Since(t0))
			mu.Unlock()
		}
	})
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(len(lat))/elapsed.Seconds(), "creates/s")
	reportLatencies(b, lat)
}

// BenchmarkFailover measures, per iteration, the time from killing the
// leader of a fresh 3-server cluster to the next successful CreateVolume
// through a client that knows all three addresses (the stor-ctl client,
// which retries Unavailable). Run with -benchtime=Nx.
func BenchmarkFailover(b *testing.B) {
	var took []time.Duration
	for i := range b.N {
		b.StopTimer()
		c := servertest.NewCluster(b, servertest.Options{})
		addrs := []string{c.Nodes[0].Addr, c.Nodes[1].Addr, c.Nodes[2].Addr}
		cl, err := client.Dial(addrs)
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if _, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: "warm", SizeBytes: 1 << 30}); err != nil {
			b.Fatal(err)
		}
		leader := c.Leader(10 * time.Second)
		b.StartTimer()
		start := time.Now()
		c.Kill(leader)
		if _, err := cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: fmt.Sprintf("after-%d", i), SizeBytes: 1 << 30, ReplicaCount: 2}); err != nil {
			b.Fatal(err)
		}
		took = append(took, time.Since(start))
		b.StopTimer()
		cancel()
		cl.Close()
		c.Close()
	}
	slices.Sort(took)
	b.ReportMetric(float64(percentile(took, 50).Milliseconds()), "p50-failover-ms")
	b.ReportMetric(float64(took[len(took)-1].Milliseconds()), "max-failover-ms")
}
