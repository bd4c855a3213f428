// Sandlot run_code, csharp: the entry point around the program's own Main, so that the
// program runs as under `dotnet run` (SandboxFusion's csharp runner): a failed
// Debug.Assert/Trace.Assert ends the process as .NET's does ("Process terminated.
// Assertion failed." and the message on stderr, exit 134 = SIGABRT) instead of mono's
// silent default listener.
using System;
using System.Diagnostics;
using System.Reflection;
using System.Threading.Tasks;

sealed class SandlotAssertListener : TraceListener
{
    public override void Write(string message) { }
    public override void WriteLine(string message) { }
    public override void Fail(string message) { Fail(message, null); }
    public override void Fail(string message, string detail)
    {
        Console.Out.Flush();
        Console.Error.WriteLine("Process terminated. Assertion failed.");
        if (!string.IsNullOrEmpty(message)) Console.Error.WriteLine(message);
        if (!string.IsNullOrEmpty(detail)) Console.Error.WriteLine(detail);
        Console.Error.WriteLine(new StackTrace(2, true).ToString());
        Console.Error.Flush();
        Environment.Exit(134);
    }
}

static class SandlotEntry
{
    static int Main(string[] args)
    {
        Trace.Listeners.Clear();
        Trace.Listeners.Add(new SandlotAssertListener());
        MethodInfo main = null;
        foreach (Type t in typeof(SandlotEntry).Assembly.GetTypes())
        {
            if (t == typeof(SandlotEntry)) continue;
            foreach (MethodInfo m in t.GetMethods(BindingFlags.Static | BindingFlags.Public | BindingFlags.NonPublic | BindingFlags.DeclaredOnly))
            {
                if (m.Name == "Main" && !m.IsGenericMethod && m.GetParameters().Length <= 1) { main = m; break; }
            }
            if (main != null) break;
        }
        if (main == null)
        {
            Console.Error.WriteLine("error CS5001: Program does not contain a static 'Main' method suitable for an entry point");
            return 1;
        }
        bool withArgs = main.GetParameters().Length == 1;
        Type ret = main.ReturnType;
        if (ret == typeof(int))
            return withArgs ? ((Func<string[], int>)Delegate.CreateDelegate(typeof(Func<string[], int>), main))(args)
                            : ((Func<int>)Delegate.CreateDelegate(typeof(Func<int>), main))();
        if (ret == typeof(Task<int>))
            return withArgs ? ((Func<string[], Task<int>>)Delegate.CreateDelegate(typeof(Func<string[], Task<int>>), main))(args).GetAwaiter().GetResult()
                            : ((Func<Task<int>>)Delegate.CreateDelegate(typeof(Func<Task<int>>), main))().GetAwaiter().GetResult();
        if (ret == typeof(Task))
        {
            Task task = withArgs ? ((Func<string[], Task>)Delegate.CreateDelegate(typeof(Func<string[], Task>), main))(args)
                                 : ((Func<Task>)Delegate.CreateDelegate(typeof(Func<Task>), main))();
            task.GetAwaiter().GetResult();
            return 0;
        }
        if (withArgs) ((Action<string[]>)Delegate.CreateDelegate(typeof(Action<string[]>), main))(args);
        else ((Action)Delegate.CreateDelegate(typeof(Action), main))();
        return 0;
    }
}
