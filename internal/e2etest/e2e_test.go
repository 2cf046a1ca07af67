package e2etest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	storpb "github.com/stor-io/stor/api/proto"
)

const (
	gib         = 1 << 30
	volumeCount = 10
)

// Bounds on what the tests wait for.
const (
	formTimeout     = 30 * time.Second // three processes start and form a cluster
	failoverTimeout = 10 * time.Second // survivors answer after the leader dies
	downTimeout     = 20 * time.Second // --server-down-timeout 3s plus an election
	rejoinTimeout   = 30 * time.Second // a restarted server is back and caught up
)

// TestThreeProcessesSurviveLeaderKill runs three stor-server processes,
// creates volumes, SIGKILLs the Raft leader, and checks through stor-ctl
// that the survivors still serve every volume, accept new ones, mark the
// dead server down, and that the killed server rejoins from its data dir.
func TestThreeProcessesSurviveLeaderKill(t *testing.T) {
	c, st := startThree(t)
	all := c.addrs()

	clusterID := st.GetClusterId()

	var want []string
	for i := 1; i <= volumeCount; i++ {
		name := fmt.Sprintf("v-%d", i)
		var v storpb.Volume
		mustCtlJSON(t, &v, "--server", all, "volume", "create", name, "--size", "1GiB", "--replicas", "3", "-o", "json")
		if err := checkVolume(&v, name, 3); err != nil {
			t.Fatalf("volume create %s: %v", name, err)
		}
		want = append(want, name)
	}

	mustCtlJSON(t, st, "--server", all, "cluster", "status", "-o", "json")
	if st.GetLeaderId() == "" {
		t.Fatalf("cluster status names no leader: %v", st)
	}
	victim := c.server(t, st.GetLeaderId())
	t.Logf("killing the leader %s (pid %d) with SIGKILL", victim.id, victim.cmd.Process.Pid)
	victim.kill(t)
	survivors := c.addrs(victim)

	// Every volume is still listed through the survivors.
	var list storpb.ListVolumesResponse
	c.eventually(t, failoverTimeout, "volume list through the survivors", func() error {
		return ctlJSON(t, &list, "--server", survivors, "--timeout", "3s", "volume", "list", "-o", "json")
	})
	if missing := missingVolumes(&list, want); len(missing) > 0 {
		t.Fatalf("after killing the leader, volume list lacks %q; it lists %q", missing, volumeNames(&list))
	}

	// A new volume can be created right away.
	var v storpb.Volume
	mustCtlJSON(t, &v, "--server", survivors, "volume", "create", "v-11", "--size", "1GiB", "--replicas", "2", "-o", "json")
	if err := checkVolume(&v, "v-11", 2); err != nil {
		t.Fatalf("volume create v-11 after the leader was killed: %v", err)
	}
	want = append(want, "v-11")

	// The new leader marks the killed server down.
	c.eventually(t, downTimeout, victim.id+" is down in server list", func() error {
		var servers storpb.ListServersResponse
		if err := ctlJSON(t, &servers, "--server", survivors, "--timeout", "3s", "server", "list", "-o", "json"); err != nil {
			return err
		}
		return serverState(&servers, victim.id, storpb.ServerState_SERVER_STATE_DOWN)
	})

	// Once it is down, placement leaves it out: two replicas fit on the
	// survivors, three do not.
	mustCtlJSON(t, &v, "--server", survivors, "volume", "create", "v-12", "--size", "1GiB", "--replicas", "2", "-o", "json")
	if err := checkVolume(&v, "v-12", 2); err != nil {
		t.Fatalf("volume create v-12 with %s down: %v", victim.id, err)
	}
	for _, r := range v.GetReplicas() {
		if r.GetServerId() == victim.id {
			t.Errorf("volume v-12, created with %s down, has a replica on it: %v", victim.id, &v)
		}
	}
	want = append(want, "v-12")
	res := runCtl(t, "--server", survivors, "volume", "create", "v-13", "--size", "1GiB", "--replicas", "3")
	if res.exit != 1 || !strings.Contains(res.stderr, "not enough servers") {
		t.Errorf("volume create v-13 --replicas 3 with one of three servers down: exit %d, stderr %q; want exit 1 and a message saying there are not enough servers",
			res.exit, res.stderr)
	}

	// The killed server restarts with the same flags and data dir and
	// rejoins the same cluster.
	victim.start(t)
	c.eventually(t, rejoinTimeout, victim.id+" is an up member again", func() error {
		if err := ctlJSON(t, st, "--server", survivors, "--timeout", "2s", "cluster", "status", "-o", "json"); err != nil {
			return err
		}
		if err := membersUp(st, "s1", "s2", "s3"); err != nil {
			return err
		}
		var servers storpb.ListServersResponse
		if err := ctlJSON(t, &servers, "--server", survivors, "--timeout", "2s", "server", "list", "-o", "json"); err != nil {
			return err
		}
		return serverState(&servers, victim.id, storpb.ServerState_SERVER_STATE_UP)
	})
	var leader storpb.StatusResponse
	mustCtlJSON(t, &leader, "--server", st.GetLeaderAddress(), "cluster", "status", "-o", "json")
	if leader.GetServerId() != leader.GetLeaderId() || leader.GetServerId() == victim.id {
		t.Fatalf("asked the leader %s (%s) for its status; got %v", st.GetLeaderId(), st.GetLeaderAddress(), &leader)
	}
	var local storpb.StatusResponse
	c.eventually(t, rejoinTimeout, fmt.Sprintf("%s applied index catches up with the leader's %d", victim.id, leader.GetAppliedIndex()), func() error {
		if err := ctlJSON(t, &local, "--server", victim.addr, "--timeout", "2s", "cluster", "status", "-o", "json"); err != nil {
			return err
		}
		if local.GetAppliedIndex() < leader.GetAppliedIndex() || local.GetLeaderId() != leader.GetServerId() {
			return fmt.Errorf("%s reports applied index %d and leader %q", victim.id, local.GetAppliedIndex(), local.GetLeaderId())
		}
		return nil
	})
	if local.GetClusterId() != clusterID || local.GetServerId() != victim.id {
		t.Errorf("restarted %s reports server %q in cluster %q; want itself in cluster %q", victim.id, local.GetServerId(), local.GetClusterId(), clusterID)
	}

	// Asked through the restarted server alone, the cluster has every volume.
	mustCtlJSON(t, &list, "--server", victim.addr, "volume", "list", "-o", "json")
	if missing := missingVolumes(&list, want); len(missing) > 0 || len(list.GetVolumes()) != len(want) {
		t.Errorf("volume list through the restarted %s lists %q; want %q", victim.id, volumeNames(&list), want)
	}
}

// TestRefusesForeignDataDir checks that stor-server exits at once, with a
// message naming the problem, rather than use a data dir that is not its
// own.
func TestRefusesForeignDataDir(t *testing.T) {
	requireBinaries(t)

	t.Run("unrelated files", func(t *testing.T) {
		dir := t.TempDir()
		notes := filepath.Join(dir, "notes.txt")
		if err := os.WriteFile(notes, []byte("not stor's\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		s := newServer(t, "s1", dir, "")
		code, stderr := runToExit(t, s)
		if code == 0 || !strings.Contains(stderr, "not a stor data directory") {
			t.Errorf("stor-server on a dir holding notes.txt: exit %d, stderr %q; want a non-zero exit and \"not a stor data directory\"", code, stderr)
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(notes); err != nil || string(b) != "not stor's\n" || len(entries) != 1 {
			t.Errorf("the refused dir was changed: notes.txt %q (%v), %d entries", b, err, len(entries))
		}
	})

	t.Run("another server's dir", func(t *testing.T) {
		c := newCluster(t, 1)
		s1 := c.servers[0]
		s1.start(t)
		var st storpb.StatusResponse
		c.eventually(t, formTimeout, "s1 bootstraps", func() error {
			if err := ctlJSON(t, &st, "--server", s1.addr, "--timeout", "2s", "cluster", "status", "-o", "json"); err != nil {
				return err
			}
			return membersUp(&st, "s1")
		})
		if err := s1.stop(t); err != nil {
			t.Fatalf("s1 after SIGTERM: %v; want exit status 0", err)
		}

		dataDir := s1.args[slices.Index(s1.args, "--data-dir")+1]
		s9 := newServer(t, "s9", dataDir, "")
		code, stderr := runToExit(t, s9)
		if code == 0 || !strings.Contains(stderr, `"s1"`) || !strings.Contains(stderr, `"s9"`) {
			t.Errorf("stor-server --id s9 on s1's data dir: exit %d, stderr %q; want a non-zero exit and a message naming s1 and s9", code, stderr)
		}

		// The refusal left the dir intact: s1 resumes in its cluster.
		s1.start(t)
		var again storpb.StatusResponse
		c.eventually(t, formTimeout, "s1 resumes", func() error {
			if err := ctlJSON(t, &again, "--server", s1.addr, "--timeout", "2s", "cluster", "status", "-o", "json"); err != nil {
				return err
			}
			return membersUp(&again, "s1")
		})
		if again.GetClusterId() != st.GetClusterId() {
			t.Errorf("s1 restarted in cluster %q; it was in %q", again.GetClusterId(), st.GetClusterId())
		}
	})
}

// runToExit runs s's binary with its flags and returns its exit code and
// stderr, failing t if it does not exit within exitTimeout.
func runToExit(t *testing.T, s *server) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), exitTimeout)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, serverBin, s.args...)
	cmd.Env = processEnv()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("stor-server %s: still running after %v; stderr:\n%s", strings.Join(s.args, " "), exitTimeout, stderr.String())
	}
	t.Logf("stor-server --id %s exited after %v: %v", s.id, time.Since(start).Round(time.Millisecond), err)
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// membersUp checks that a status names a leader and lists exactly ids as
// members, each up.
func membersUp(st *storpb.StatusResponse, ids ...string) error {
	if st.GetLeaderId() == "" {
		return fmt.Errorf("%s knows no leader", st.GetServerId())
	}
	var got []string
	for _, m := range st.GetMembers() {
		if m.GetState() != storpb.ServerState_SERVER_STATE_UP {
			return fmt.Errorf("%s sees member %s %v", st.GetServerId(), m.GetId(), m.GetState())
		}
		got = append(got, m.GetId())
	}
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		return fmt.Errorf("%s sees members %q, want %q", st.GetServerId(), got, ids)
	}
	return nil
}

// serverState checks that server list shows id in state want.
func serverState(resp *storpb.ListServersResponse, id string, want storpb.ServerState) error {
	for _, s := range resp.GetServers() {
		if s.GetId() == id {
			if s.GetState() != want {
				return fmt.Errorf("server %s is %v, want %v", id, s.GetState(), want)
			}
			return nil
		}
	}
	return fmt.Errorf("server list does not show %s", id)
}

// checkVolume checks what volume create returned: the name, 1 GiB, and
// replicas on distinct servers.
func checkVolume(v *storpb.Volume, name string, replicas int) error {
	if v.GetName() != name || v.GetId() == "" || v.GetSizeBytes() != gib || int(v.GetReplicaCount()) != replicas {
		return fmt.Errorf("got name %q id %q size %d replica count %d; want %s, 1GiB, %d replicas",
			v.GetName(), v.GetId(), v.GetSizeBytes(), v.GetReplicaCount(), name, replicas)
	}
	servers := map[string]bool{}
	for _, r := range v.GetReplicas() {
		servers[r.GetServerId()] = true
	}
	if len(v.GetReplicas()) != replicas || len(servers) != replicas {
		return fmt.Errorf("replicas %v are not on %d distinct servers", v.GetReplicas(), replicas)
	}
	return nil
}

func volumeNames(list *storpb.ListVolumesResponse) []string {
	var names []string
	for _, v := range list.GetVolumes() {
		names = append(names, v.GetName())
	}
	slices.Sort(names)
	return names
}

func missingVolumes(list *storpb.ListVolumesResponse, want []string) []string {
	got := volumeNames(list)
	var missing []string
	for _, name := range want {
		if !slices.Contains(got, name) {
			missing = append(missing, name)
		}
	}
	return missing
}

// startThree starts s1..s3 (s1 bootstraps) and waits until all three are
// up members with a leader; it returns the cluster and that status.
func startThree(t *testing.T) (*cluster, *storpb.StatusResponse) {
	t.Helper()
	requireBinaries(t)
	c := newCluster(t, 3)
	c.startAll(t)
	all := c.addrs()
	st := &storpb.StatusResponse{}
	c.eventually(t, formTimeout, "3 members up with a leader", func() error {
		if err := ctlJSON(t, st, "--server", all, "--timeout", "2s", "cluster", "status", "-o", "json"); err != nil {
			return err
		}
		return membersUp(st, "s1", "s2", "s3")
	})
	return c, st
}
